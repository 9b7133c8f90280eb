"""Pins for mixedad._hooks.autocast: CPU autocast is seen, in and out of the block."""
import torch

from mixedad._hooks.autocast import cpu_autocast_on


def test_cpu_autocast_is_seen():
    assert not cpu_autocast_on()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert cpu_autocast_on()
        with torch.autocast("cpu", enabled=False):
            assert not cpu_autocast_on()
    assert not cpu_autocast_on()
