"""thread_local.setting: a value for one block, in one thread, put back even where the block raises."""
import threading

import pytest

from mixedad._hooks.thread_local import setting


def test_a_setting_holds_inside_the_block_and_goes_back_after():
    local = threading.local()
    with setting(local, "x", 1):
        assert local.x == 1
        with setting(local, "x", 2):
            assert local.x == 2
        assert local.x == 1
    assert local.x is None
    with pytest.raises(KeyError), setting(local, "x", 3):
        raise KeyError("inside")
    assert local.x is None


def test_a_setting_is_seen_in_its_own_thread_alone():
    local, seen = threading.local(), []
    with setting(local, "x", 1):
        thread = threading.Thread(target=lambda: seen.append(getattr(local, "x", "unset")))
        thread.start()
        thread.join()
    assert seen == ["unset"]
