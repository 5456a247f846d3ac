"""The training CLIs' GPU memory allocator: the stream-ordered one unless the user named another."""

from train.harness import allocator


def test_an_unset_allocator_becomes_the_stream_ordered_one():
    environ = {"PATH": "/usr/bin"}
    assert allocator.choose_allocator(environ) == "cuda_async"
    assert environ == {"PATH": "/usr/bin", "XLA_PYTHON_CLIENT_ALLOCATOR": "cuda_async"}


def test_the_users_allocator_stays_even_when_empty():
    for chosen in ("bfc", "platform", ""):
        environ = {"XLA_PYTHON_CLIENT_ALLOCATOR": chosen}
        assert allocator.choose_allocator(environ) == chosen
        assert environ == {"XLA_PYTHON_CLIENT_ALLOCATOR": chosen}
