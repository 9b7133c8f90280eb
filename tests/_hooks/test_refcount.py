"""mixedad._hooks.refcount: a patch installed by the first user and removed by the last, across threads."""
import threading

from mixedad._hooks.refcount import SharedPatch


def test_first_in_installs_last_out_uninstalls():
    events = []
    patch = SharedPatch(lambda: events.append("install"), lambda: events.append("uninstall"))
    with patch.use():
        with patch.use():
            assert events == ["install"]
        assert events == ["install"]
    assert events == ["install", "uninstall"] and patch.users == 0


def test_many_threads_leave_it_uninstalled():
    events = []
    patch = SharedPatch(lambda: events.append(1), lambda: events.append(-1))

    def work():
        for _ in range(200):
            with patch.use():
                pass

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert patch.users == 0 and sum(events) == 0 and events[-1] == -1
