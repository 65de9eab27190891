import pytest
import torch

from nsaserve.kernels.quant import (
    INDEXER_K_BYTES,
    MLA_KV_BYTES,
    decode_mla_kv,
    encode_indexer_k,
    encode_mla_kv,
    read_indexer_k,
    read_mla_kv,
    write_indexer_k,
    write_mla_kv,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def le_bytes(x: float) -> list[int]:
    return list(torch.tensor([x], dtype=torch.float32).view(torch.uint8).tolist())


def test_sizes():
    assert MLA_KV_BYTES == 512 + 4 * 4 + 64 * 2 == 656
    assert INDEXER_K_BYTES == 128 + 4 == 132


def test_mla_row_hand_computed_bytes():
    latent = torch.zeros(1, 512)
    latent[0, 0] = 896.0  # tile 0: amax 896 -> scale 2 (power of two) -> 448 = e4m3 0x7E
    latent[0, 128] = -1.0  # tile 1: amax 1 -> 1/448 rounded up to 2^-8 -> -256 = e4m3 0xF8
    rope = torch.zeros(1, 64)
    rope[0, 0] = 1.0  # bf16 0x3F80
    rope[0, 63] = -2.0  # bf16 0xC000
    row = encode_mla_kv(latent, rope)[0].tolist()
    assert len(row) == 656
    assert row[0] == 0x7E and row[128] == 0xF8 and set(row[1:128]) == {0}
    assert row[512:516] == [0x00, 0x00, 0x00, 0x40] == le_bytes(2.0)
    assert row[516:520] == le_bytes(2.0**-8) == [0x00, 0x00, 0x80, 0x3B]
    assert row[520:524] == le_bytes(2.0**-13)  # all-zero tile: 1e-4 floor rounded up to 2^-13
    assert row[528:530] == [0x80, 0x3F] and row[654:656] == [0x00, 0xC0]
    latent_out, rope_out = decode_mla_kv(torch.tensor([row], dtype=torch.uint8))
    assert torch.equal(latent_out, latent) and torch.equal(rope_out.float(), rope)


@pytest.mark.parametrize("scale_fmt", ["ue8m0", "float"])
@pytest.mark.parametrize("device", DEVICES)
def test_mla_round_trip_through_paged_cache(device, scale_fmt):
    g = torch.Generator().manual_seed(0)
    latent = (torch.randn(10, 512, generator=g) * torch.rand(10, 1, generator=g) * 4).to(device, torch.bfloat16)
    rope = torch.randn(10, 64, generator=g).to(device, torch.bfloat16)
    cache = torch.zeros(3, 64, 656, dtype=torch.uint8, device=device)
    slots = torch.tensor([0, 1, 63, 64, 65, 100, 127, 128, 150, 191], device=device)
    write_mla_kv(cache, slots, latent, rope, scale_fmt)
    assert int(cache[0, 2].count_nonzero()) == 0  # untouched slot stays empty
    latent_out, rope_out = read_mla_kv(cache, slots)
    assert torch.equal(rope_out, rope)  # rope is stored unquantised
    x = latent.float()
    scale = x.reshape(10, 4, 128).abs().amax(-1) / 448
    if scale_fmt == "ue8m0":
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    scale = scale.repeat_interleave(128, -1)
    allowed = torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-10) * (1 + 1e-6)
    assert bool(((latent_out - x).abs() <= allowed).all())
    # Slot s is row s of the flattened cache: page s // 64, offset s % 64.
    assert torch.equal(cache[1, 36], encode_mla_kv(latent[5:6], rope[5:6], scale_fmt)[0])


def test_mla_rejects_wrong_shapes():
    with pytest.raises(ValueError):
        encode_mla_kv(torch.zeros(2, 576), torch.zeros(2, 64))
    with pytest.raises(ValueError):
        read_mla_kv(torch.zeros(4, 576, dtype=torch.uint8), torch.tensor([0]))


def test_indexer_page_layout_hand_computed():
    cache = torch.zeros(2, 4, 132, dtype=torch.uint8)  # 2 pages of 4 tokens
    k = torch.zeros(1, 128)
    k[0, 0], k[0, 127] = 3.5, -0.4375  # amax 3.5 -> scale 2^-7 exactly -> 448 and -56
    write_indexer_k(cache, torch.tensor([5]), k)  # slot 5 = page 1, offset 1
    page = cache[1].reshape(-1).tolist()
    assert page[128] == 0x7E and page[255] == 0xE6  # token 1 values start at 128 * 1; -56 = 1.75 * 2^5 -> 1|1100|110
    assert page[4 * 128 + 4 : 4 * 128 + 8] == le_bytes(2.0**-7) == [0, 0, 0, 0x3C]
    assert sum(1 for b in page if b) == 3 and int(cache[0].count_nonzero()) == 0
    values, scales = read_indexer_k(cache, torch.tensor([5]))
    assert values.dtype == torch.float8_e4m3fn and scales.tolist() == [2.0**-7]
    assert torch.equal(values.float() * scales[:, None], k)


@pytest.mark.parametrize("device", DEVICES)
def test_indexer_round_trip_matches_encoder(device):
    g = torch.Generator().manual_seed(1)
    k = (torch.randn(20, 128, generator=g) * 3).to(device, torch.bfloat16)
    cache = torch.zeros(4, 64, 132, dtype=torch.uint8, device=device)
    slots = torch.randperm(256, generator=g)[:20].to(device)
    write_indexer_k(cache, slots, k)
    values, scales = read_indexer_k(cache, slots)
    ref_values, ref_scales = encode_indexer_k(k)
    assert torch.equal(values.view(torch.uint8), ref_values.view(torch.uint8)) and torch.equal(scales, ref_scales)
    mant, _ = torch.frexp(scales)
    assert bool((mant == 0.5).all())  # ue8m0: powers of two
    x = k.float()
    allowed = torch.maximum(x.abs() * 2.0**-4, scales[:, None] * 2.0**-10) * (1 + 1e-6)
    assert bool(((values.float() * scales[:, None] - x).abs() <= allowed).all())
