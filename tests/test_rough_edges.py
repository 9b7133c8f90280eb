"""The rough edges a new user hits: each is an answer or a clear mixedad error, never torch's own crash."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import mixedad
from mixedad import zoo
from mixedad.cli import main
from mixedad.reference import double_backward_mixed_grad
from mixedad.testing import assert_close

F64 = torch.float64


def cubic(y, g):
    return ((y + g) ** 3).sum()


def test_expanded_z_and_v_with_zero_strides():
    G = zoo.mlp(2, 8, dtype=F64)
    z = torch.randn(1, 8, dtype=F64).expand(4, 8)
    v = torch.randn(1, 8, dtype=F64).expand(4, 8)
    y = torch.randn(4, 8, dtype=F64)
    assert_close(mixedad.mixed_grad(cubic, G, z, y, v), double_backward_mixed_grad(cubic, G, z, y, v))


def test_input_grad_on_zero_latent_codes_with_chunks():
    G = zoo.mlp(2, 8, dtype=F64)
    y = torch.randn(8, dtype=F64, requires_grad=True)
    dfdz = mixedad.input_grad(cubic, G, torch.randn(0, 8, dtype=F64), y, chunk_size=2)
    assert dfdz.shape == (0, 8)
    dfdz.sum().backward()
    assert torch.equal(y.grad, torch.zeros(8, dtype=F64))


@pytest.mark.parametrize("chunk_size", [np.int64(2), torch.tensor(2), 2])
def test_chunk_size_takes_integer_likes(chunk_size):
    G = zoo.mlp(2, 8, dtype=F64)
    z, y = torch.randn(4, 8, dtype=F64), torch.randn(8, dtype=F64)
    assert_close(mixedad.input_grad(cubic, G, z, y, chunk_size=chunk_size),
                 mixedad.input_grad(cubic, G, z, y, chunk_size=2))


@pytest.mark.parametrize("chunk_size", [2.0, True, torch.tensor([2, 3])])
def test_chunk_size_refuses_non_integers(chunk_size):
    G = zoo.mlp(2, 8, dtype=F64)
    with pytest.raises(TypeError, match=r"input_grad\(f, G, z, y\): expected chunk_size to be None or a positive int"):
        mixedad.input_grad(cubic, G, torch.randn(4, 8, dtype=F64), torch.randn(8, dtype=F64), chunk_size=chunk_size)


def test_eval_batch_norm_rule_on_an_empty_one_dimensional_input():
    mean, var = torch.zeros(0, dtype=F64), torch.ones(0, dtype=F64)
    G = lambda x: F.batch_norm(x, mean, var)  # noqa: E731
    z = torch.randn(0, dtype=F64)
    assert mixedad.mixed_grad(cubic, G, z, torch.randn(0, dtype=F64)).shape == (0,)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
@pytest.mark.parametrize("command", ["demo", "profile"])
def test_cli_without_cuda_says_so(command):
    with pytest.raises(SystemExit, match=f"python -m mixedad {command}: --device cuda, but no CUDA device"):
        main([command, "--device", "cuda"])


@pytest.mark.parametrize("make_out", ["file", "unwritable"])
def test_profile_checks_out_before_the_sweep(tmp_path, monkeypatch, make_out):
    from mixedad import benchmark

    def sweep(*args, **kwargs):
        raise AssertionError("the sweep ran before --out was checked")

    monkeypatch.setattr(benchmark, "profile", sweep)
    if make_out == "file":
        out = tmp_path / "results.json"
        out.write_text("{}")
        message = "exists and is not a folder"
    else:
        out = tmp_path / "a-file" / "below"
        (tmp_path / "a-file").write_text("")
        message = "cannot write to --out"
    with pytest.raises(SystemExit, match=message):
        main(["profile", "--depths", "2", "--out", str(out)])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_demo_runs_in_half_precision(dtype, capsys):
    main(["demo", "--dtype", dtype, "--depth", "2", "--width", "8", "--batch", "4", "--repeats", "1"])
    assert "mixedad.mixed_grad" in capsys.readouterr().out


def test_f_that_writes_into_g():
    from mixedad.reference import double_backward_input_grad

    G = zoo.mlp(2, 4, dtype=F64)
    z, y = torch.randn(3, 4, dtype=F64), torch.randn(3, 4, dtype=F64)
    f = lambda y, g: ((y + g.mul_(2)) ** 3).sum()  # noqa: E731
    expected = double_backward_mixed_grad(f, G, z, y)
    assert_close(mixedad.mixed_grad(f, G, z, y), expected)
    assert_close(torch.func.vmap(lambda v: mixedad.mixed_grad(f, G, z, y, v))(torch.ones(2, 3, 4, dtype=F64))[1], expected)
    assert_close(mixedad.input_grad(f, G, z, y), double_backward_input_grad(f, G, z, y))


def test_scripted_generator_in_input_grad():
    from mixedad.reference import double_backward_input_grad

    G = zoo.mlp(2, 4, dtype=F64)
    z, y = torch.randn(3, 4, dtype=F64), torch.randn(4, dtype=F64, requires_grad=True)
    ours = mixedad.input_grad(cubic, torch.jit.script(G), z, y)
    assert_close(ours, double_backward_input_grad(cubic, G, z, y.detach().clone().requires_grad_()))
    ours.sum().backward()
    assert all(p.grad is None for p in G.parameters())


def test_integer_z_gets_advice_about_indices_not_a_conversion():
    embedding = torch.nn.Embedding(10, 4).to(F64)
    with pytest.raises(TypeError, match="no derivative with respect to integer indices"):
        mixedad.mixed_grad(cubic, embedding, torch.tensor([1, 2, 3]), torch.randn(3, 4, dtype=F64))


def test_a_dict_leaf_is_named_as_python_would():
    G = zoo.mlp(2, 4, dtype=F64)
    with pytest.raises(TypeError, match=r"expected y\['k'\] to be a real floating-point tensor, got dtype "
                                        r"torch.int64. Convert it, e.g. y\['k'\].to\(torch.float32\)"):
        mixedad.mixed_grad(lambda y, g: (y["k"] * g).sum(), G, torch.randn(3, 4, dtype=F64),
                           {"k": torch.ones(3, 4, dtype=torch.int64)})


def test_eager_penalties_then_an_in_place_op_and_number_like_weights():
    from mixedad import EagerPenalties

    torch.manual_seed(0)
    net1, net2 = torch.nn.Linear(4, 4).double(), torch.nn.Linear(4, 1).double()
    x = torch.randn(5, 4, dtype=F64)
    penalty = lambda h: (h ** 2).sum()  # noqa: E731

    def run(eager):
        for p in (*net1.parameters(), *net2.parameters()):
            p.grad = None
        h = net1(x)
        if eager:
            ep = EagerPenalties()
            h = ep.add(h, penalty, weight=np.float32(0.5))
            h = ep.add(h, penalty, weight=torch.tensor(0.25, dtype=F64))
            loss = net2(F.relu(h, inplace=True)).sum()
        else:
            loss = net2(F.relu(h.clone(), inplace=True)).sum() + 0.75 * penalty(h)
        loss.backward()
        return [p.grad.clone() for p in net1.parameters()]

    for ours, naive in zip(run(True), run(False)):
        assert_close(ours, naive)


def test_a_failure_from_a_compiled_part_says_what_to_do():
    """Stands in for aot_autograd's Function, named as torch names it, which refuses double backward
    (compiling for real takes minutes). mixedad finds it in the graph, not in the error's text."""

    class CompiledFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            raise RuntimeError("double backward is not supported here")

    G = lambda z: CompiledFunction.apply(z).sin()  # noqa: E731
    with pytest.raises(RuntimeError, match=r"mixed_grad\(f, G, z, y\): .*torch.compile'd submodule inside G.*_orig_mod"):
        mixedad.mixed_grad(cubic, G, torch.randn(3, dtype=F64), torch.randn(3, dtype=F64))
