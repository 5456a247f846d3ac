"""The training CLIs' GPU memory allocator: the stream-ordered one unless the user named another, chosen by the entry
point before JAX starts."""

from train.harness import entry


def test_an_unset_allocator_becomes_the_stream_ordered_one():
    environ = {"PATH": "/usr/bin"}
    assert entry.choose_allocator(environ) == "cuda_async"
    assert environ == {"PATH": "/usr/bin", "XLA_PYTHON_CLIENT_ALLOCATOR": "cuda_async"}


def test_the_users_allocator_stays_even_when_empty():
    for chosen in ("bfc", "platform", ""):
        environ = {"XLA_PYTHON_CLIENT_ALLOCATOR": chosen}
        assert entry.choose_allocator(environ) == chosen
        assert environ == {"XLA_PYTHON_CLIENT_ALLOCATOR": chosen}


def test_the_entry_point_chooses_it(monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_ALLOCATOR", raising=False)
    monkeypatch.setattr(entry, "stop_at_start_up", lambda: None)
    entry.start(["--no-tensorboard"])
    assert entry.os.environ["XLA_PYTHON_CLIENT_ALLOCATOR"] == "cuda_async"
