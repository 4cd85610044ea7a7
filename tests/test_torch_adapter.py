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


def test_fingerprints_are_exact_and_see_a_changed_or_moved_word():
    from weightpull.integrations.torch_tensors import fingerprints

    a = torch.randn(1000, 128, dtype=torch.bfloat16)
    changed = a.clone()
    changed.view(-1)[777] += 1
    sums = fingerprints(
        {
            "a": a,
            "same": a.clone(),
            "changed": changed,
            "rolled": torch.roll(a, 1, 0),
            "empty": torch.empty(0),
            "three_bytes": torch.ones(3, dtype=torch.uint8),
        }
    )
    assert sums["a"] == sums["same"] and sums["a"] != sums["changed"] and sums["a"] != sums["rolled"]
    assert sums["empty"] == 0 and sums["three_bytes"] == 1 + 3 + 5  # each byte times 2 * its place + 1
    n, period = 3 * 65521 * 256 + 5, 65521  # several chunks
    big = torch.full((n,), 2**62, dtype=torch.int64)  # the sum wraps modulo 2**64
    weights = (n // period) * period * period + (n % period) ** 2  # the sum of the first k odd numbers is k**2
    assert fingerprints({"big": big})["big"] == (2**62 * weights + 2**63) % 2**64 - 2**63


async def test_the_core_views_a_mirror_as_torch_tensors_through_the_plugin(world):
    """`weightpull.tensors.as_tensors`, the core's, finds torch's views by entry point: the
    same views, by name, into the mirror itself (no copy)."""
    from weightpull.integrations.torch_tensors import TorchAdapter
    from weightpull.tensors import adapter_for
    from weightpull.tensors import as_tensors as core_as_tensors

    assert isinstance(adapter_for(torch.ones(1)), TorchAdapter)  # the adapter, by the tensor type's module
    await world.publisher(rollout_dtype=None).publish(1, model(1))
    pulled = await world.puller().pull()
    got = core_as_tensors(pulled.layout, pulled.region)
    want = as_tensors(pulled.layout, pulled.region)
    assert list(got) == list(want) == [p.spec.name for p in pulled.layout.placements]
    for name, t in model(1).items():
        assert torch.equal(got[name], t)
        assert got[name].data_ptr() == want[name].data_ptr()  # a view of the same bytes
    got["step"].fill_(7)  # writing through the view writes the mirror
    assert as_tensors(pulled.layout, pulled.region)["step"].item() == 7
