"""Every training task by name (``train.wmt``, ``train.imdb``, ``train.gpt``): the one list the tools that compare
and sweep runs read a task's quality metric, flags and batch axes from. A new task is its package and a line here.
"""

from __future__ import annotations

from train.gpt.task import TASK as GPT
from train.harness.training import Task
from train.imdb.task import TASK as IMDB
from train.wmt.task import TASK as WMT

TASKS: dict[str, Task] = {task.name: task for task in (IMDB, WMT, GPT)}
