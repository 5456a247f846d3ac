"""What `python -m train.compare` does: read run logs (`runs`), score them (`scoring`), write tables and
report.md (`tables`) and figures (`plots`)."""
