"""Block-scaled fp8 on the wire (weightpull.integrations.fp8): the quantization against a
block-by-block oracle, the checkpoint's names, dtypes and scale shapes, a publish through
the torch adapter and through `SnapshotPublisher(fp8=True)` pulled back bit-exact, fp8
versions with deltas, and the refusal of a version whose form the replica does not serve.
(A real engine loading an fp8 version: tests/gpu/test_fp8_vllm_gpu.py, on the H200; vLLM's
CPU build serves block fp8 only on CPUs with AMX, which these machines lack.)"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from weightpull import InvalidArgumentError, Publisher, Puller, as_tensors  # noqa: E402
from weightpull.integrations import fp8  # noqa: E402
from weightpull.integrations.torch_snapshot import SnapshotPublisher  # noqa: E402
from weightpull.layout import TensorSpec, plan_layout  # noqa: E402

pytestmark = pytest.mark.anyio


def model(seed: int = 0) -> dict[str, torch.Tensor]:
    """A small Qwen3-shaped set: linear weights with short edge blocks, a norm, an embedding."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(300, 64, generator=g) * 0.02,
        "model.layers.0.self_attn.q_proj.weight": torch.randn(256, 64, generator=g) * 0.02,
        "model.layers.0.mlp.down_proj.weight": torch.randn(200, 300, generator=g) * 0.05,
        "model.layers.0.input_layernorm.weight": torch.ones(64),
        "lm_head.weight": torch.randn(300, 64, generator=g) * 0.02,
    }


def oracle(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The checkpoints' rule, one block at a time: the block over its largest magnitude / 448."""
    rows, cols = w.shape
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scale = torch.empty(math.ceil(rows / 128), math.ceil(cols / 128))
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            block = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].float()
            s = block.abs().max() / 448.0
            scale[i, j] = s
            q[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = (block / (s if s > 0 else 1.0)).to(
                torch.float8_e4m3fn
            )
    return q, scale


@pytest.mark.parametrize("shape", [(256, 64), (200, 300), (128, 128), (1, 129)])
def test_quantize_matches_the_block_rule_and_dequantizes_within_e4m3s_step(shape):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(1)) * 0.03
    q, scale = fp8.quantize(w)
    want_q, want_scale = oracle(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scale.dtype == torch.float32 and tuple(scale.shape) == fp8.scale_shape(shape)
    assert torch.equal(scale, want_scale)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    back = fp8.dequantize(q, scale)
    # e4m3 keeps 3 mantissa bits: within half a step, 1/16 of the value, or a subnormal's
    step = scale.repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]] * 2**-9
    assert torch.all((back - w).abs() <= w.abs() / 16 + step)
    assert q.float().abs().amax() == 448.0  # the largest magnitude maps to e4m3's largest


def test_an_all_zero_block_stays_zero():
    w = torch.zeros(130, 10)
    w[129, 0] = 1.0  # only the second row-block has a value
    q, scale = fp8.quantize(w)
    assert torch.equal(scale, torch.tensor([[0.0], [1.0]]) / 448.0)
    assert torch.equal(fp8.dequantize(q, scale), w)


def test_expand_publishes_linear_weights_as_the_checkpoints_name_them():
    tensors = model()
    published = list(fp8.expand(tensors))
    names = [n for n, _ in published]
    assert names == [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.q_proj.weight_scale_inv",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.0.mlp.down_proj.weight_scale_inv",
        "model.layers.0.input_layernorm.weight",
        "lm_head.weight",
    ]
    given = [TensorSpec(n, "float32", tuple(t.shape)) for n, t in tensors.items()]
    specs = {s.name: s for s in fp8.specs(given)}
    assert specs["model.layers.0.mlp.down_proj.weight"] == TensorSpec(
        "model.layers.0.mlp.down_proj.weight", "float8_e4m3fn", (200, 300)
    )
    assert specs["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (2, 3)
    assert specs["model.layers.0.mlp.down_proj.weight_scale_inv"].dtype == "float32"
    assert specs["lm_head.weight"].dtype == "bfloat16" and specs["model.embed_tokens.weight"].dtype == "bfloat16"
    assert fp8.is_fp8(plan_layout(specs.values())) and not fp8.is_fp8(plan_layout(given))
    from weightpull.integrations.torch_tensors import TorchAdapter
    from weightpull.tensors import adapter_for

    assert isinstance(adapter_for(published[1][1]), TorchAdapter)  # a part names its framework: torch


def check(pulled_tensors: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> None:
    for name, t in tensors.items():
        got = pulled_tensors[name]
        if fp8.quantizes(name, tuple(t.shape)):
            q, scale = fp8.quantize(t)
            assert got.dtype == torch.float8_e4m3fn and torch.equal(got.view(torch.uint8), q.view(torch.uint8))
            assert torch.equal(pulled_tensors[name + fp8.SCALE_SUFFIX], scale)
        else:
            assert got.dtype == torch.bfloat16 and torch.equal(got, t.to(torch.bfloat16))


async def test_a_publisher_casts_into_fp8_in_its_copy_and_a_puller_gets_it_bit_exact(world):
    publisher = Publisher(world.registry, world.transport(), clock=world.clock, digests=True)
    reader = world.puller()
    tensors = model()
    result = await publisher.publish(1, fp8.expand(tensors))
    assert fp8.is_fp8(result.manifest.layout)
    check(as_tensors((pulled := await reader.pull()).layout, pulled.region), tensors)
    bf16 = sum(t.numel() * 2 for t in tensors.values())
    assert result.manifest.layout.total_bytes < 0.7 * bf16  # e4m3 and its scales, against bf16


async def test_fp8_versions_take_deltas_word_by_byte(world):
    publisher = Publisher(world.registry, world.transport(), clock=world.clock, digests="wsum64", deltas=True)
    reader = world.puller()
    first = model()
    await publisher.publish(1, fp8.expand(first))
    await reader.pull()
    second = {n: t.clone() for n, t in first.items()}
    second["model.layers.0.mlp.down_proj.weight"][5, :40] *= 1.2  # a few elements of one block change
    result = await publisher.publish(2, fp8.expand(second))
    assert result.manifest.delta.word == 1  # fp8's byte: a changed e4m3 element costs 3 bytes
    pulled = await reader.pull()
    assert pulled.base == 1
    check(as_tensors(pulled.layout, pulled.region), second)


@pytest.mark.parametrize("stream", [False, True], ids=["snapshot", "streamed"])
def test_a_snapshot_publisher_publishes_fp8(stream):
    from weightpull import InProcessRegistry, create_transport

    tensors = model()
    registry = InProcessRegistry()
    specs = [TensorSpec(n, "float32", tuple(t.shape)) for n, t in tensors.items()]
    transport = create_transport("fake")
    with SnapshotPublisher(registry, transport, specs, fp8=True, stream=stream) as publisher:
        publisher.publish(1, tensors.items()).result(30)

        async def pull():
            pulled = await Puller(registry, create_transport("fake")).pull()
            return as_tensors(pulled.layout, pulled.region)

        check(publisher.call(pull), tensors)
    with pytest.raises(InvalidArgumentError, match="fp8 versions are published whole"):
        from weightpull import Sharding

        SnapshotPublisher(registry, transport, specs, fp8=True, sharding=Sharding(0, 2, {}, {}))


def test_a_replica_is_refused_a_version_of_a_form_it_does_not_serve():
    given = [TensorSpec(n, "float32", tuple(t.shape)) for n, t in model().items()]
    fp8_layout, bf16_layout = plan_layout(fp8.specs(given)), plan_layout(given)
    fp8.check_servable(fp8_layout, 3, dict(fp8.CONFIG))  # an fp8 replica takes an fp8 version
    fp8.check_servable(bf16_layout, 3, None)  # and a bf16 one a bf16 version
    with pytest.raises(
        InvalidArgumentError, match=r"v3 was published in block fp8 .* replica 'r0' serves an unquantized"
    ):
        fp8.check_servable(fp8_layout, 3, None, replica="r0")
    with pytest.raises(InvalidArgumentError, match="start the replica from a block-fp8 checkpoint"):
        fp8.check_servable(fp8_layout, 3, {"quant_method": "fp8", "weight_block_size": [64, 64]})
    with pytest.raises(InvalidArgumentError, match="v4 was published unquantized and this replica serves a block-fp8"):
        fp8.check_servable(bf16_layout, 4, dict(fp8.CONFIG))


def test_the_cast_bench_runs_both_forms_and_checks_their_bytes():
    from weightpull.integrations.bench import fp8_cast

    got = fp8_cast.run("tiny", 2, "cpu")  # asserts each cast's bytes, and fp8's against fp8.quantize
    assert set(got["forms"]) == {"bf16", "fp8"} and 0.5 < got["fp8_over_bf16_bytes"] < 1
