"""Pins for mixedad._hooks.grad_switches: every Python way to switch grad mode reaches one torch function."""
import torch

from mixedad._hooks import grad_switches

from tests._hooks.recording import Seen



def test_every_switch_reaches_set_grad_enabled_through_a_torch_function_mode():
    for switch in (torch.no_grad, lambda: torch.set_grad_enabled(False), torch.enable_grad):
        mode = Seen()
        with mode:
            with switch():
                pass
        assert set(mode.funcs) & grad_switches.GRAD_MODE_SETTERS, switch


def test_forward_ad_enabled_restores_the_flag():
    before = torch._C._is_fwd_grad_enabled()
    torch._C._set_fwd_grad_enabled(False)
    try:
        with grad_switches.forward_ad_enabled():
            assert torch._C._is_fwd_grad_enabled()
        assert not torch._C._is_fwd_grad_enabled()
    finally:
        torch._C._set_fwd_grad_enabled(before)
