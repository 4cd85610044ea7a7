"""The torch tensor adapter: the fp32 -> rollout dtype cast, and views of a mirror."""

import pytest

torch = pytest.importorskip("torch")

from weightpull.integrations.torch_tensors import as_tensors  # noqa: E402

pytestmark = pytest.mark.anyio


def model(version):
    g = torch.Generator().manual_seed(version)
    return {
        "embed.weight": torch.randn(64, 32, generator=g),
        "layer.0.weight": torch.randn(33, 17, generator=g) * 1e3,
        "layer.0.bias": torch.randn(17, generator=g).half(),
        "step": torch.tensor([version], dtype=torch.int64),
        "t.weight": torch.randn(16, 8, generator=g).t(),  # not contiguous
    }


async def test_fp32_is_cast_to_bf16_bit_exactly(world):
    pub = world.publisher(rollout_dtype="bfloat16")
    r = await pub.publish(1, model(1))
    layout = r.manifest.layout
    assert [s.dtype for s in layout.specs] == ["bfloat16", "bfloat16", "float16", "int64", "bfloat16"]
    pulled = await world.puller().pull()
    got = as_tensors(pulled.layout, pulled.region)
    for name, t in model(1).items():
        want = t.to(torch.bfloat16) if t.dtype == torch.float32 else t
        assert got[name].dtype == want.dtype and got[name].shape == want.shape
        assert torch.equal(got[name].view(-1).view(torch.uint8), want.contiguous().view(-1).view(torch.uint8))


async def test_rollout_dtype_none_keeps_fp32(world):
    pub = world.publisher(rollout_dtype=None)
    await pub.publish(1, model(1))
    pulled = await world.puller().pull()
    got = as_tensors(pulled.layout, pulled.region)
    for name, t in model(1).items():
        assert torch.equal(got[name], t)


async def test_torch_dtypes_are_accepted_as_rollout_dtype(world):
    pub = world.publisher(rollout_dtype=torch.float16)
    r = await pub.publish(1, {"w": torch.ones(4)})
    assert r.manifest.layout["w"].spec.dtype == "float16"
