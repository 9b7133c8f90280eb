"""Pins for mixedad._hooks.threads: Thread.start ends in a module global of threading that the watch wraps."""
import threading

from mixedad._hooks import threads as hook


def test_thread_start_calls_the_module_global_the_watch_wraps():
    assert hook._STARTERS, "threading starts threads through _start_new_thread or _start_joinable_thread"
    with hook.watching_threads() as started:
        worker = threading.Thread(target=lambda: None)
        worker.start()
        worker.join()
    assert len(started) == 1


def test_unwatched_blocks_are_not_counted():
    with hook.watching_threads() as started:
        with hook.unwatched():
            worker = threading.Thread(target=lambda: None)
            worker.start()
            worker.join()
    assert started == []
