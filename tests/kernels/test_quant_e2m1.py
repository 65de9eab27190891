import pytest
import torch

from nsaserve.kernels.quant.e2m1 import decode_e2m1, e2m1_value_table, encode_e2m1, pack_e2m1, unpack_e2m1

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def e2m1_code_reference(value: float) -> int:
    """Nearest e2m1 code by exhaustive search; exact ties pick the even code; sign bit if value < 0."""
    mag = min(abs(value), 6.0)
    best = min(range(8), key=lambda i: (abs(MAGNITUDES[i] - mag), i % 2))
    return best | (8 if value < 0 else 0)


def test_value_table_is_the_e2m1_format():
    expected = [0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert e2m1_value_table().tolist() == expected
    # Cross-check against the bit definition: 1 sign, 2 exponent (bias 1), 1 mantissa bit;
    # exponent 0 is subnormal (0.m * 2^0).
    for code in range(16):
        sign = -1.0 if code & 8 else 1.0
        exp, man = (code >> 1) & 3, code & 1
        value = sign * (man * 0.5 if exp == 0 else (1 + man * 0.5) * 2.0 ** (exp - 1))
        assert decode_e2m1(torch.tensor([code])).item() == value


def test_encode_hand_vectors_including_ties():
    x = torch.tensor([0.0, 0.2, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, 7.0, 100.0, -0.75, -3.5, -0.1, -6.0])
    # 0.25 -> 0 (even), 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2.0, 2.5 -> 2.0, 3.5 -> 4.0, 5.0 -> 4.0
    expected = [0, 0, 0, 1, 2, 2, 4, 4, 6, 6, 7, 7, 7, 8 | 2, 8 | 6, 8 | 0, 8 | 7]
    assert encode_e2m1(x).tolist() == expected


@pytest.mark.parametrize("device", DEVICES)
def test_encode_matches_exhaustive_reference(device):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2000, generator=g) * 3
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    x = torch.cat([x, ties, -ties, ties.nextafter(torch.tensor(0.0)), ties.nextafter(torch.tensor(9.0))])
    got = encode_e2m1(x.to(device)).cpu().tolist()
    assert got == [e2m1_code_reference(v) for v in x.tolist()]


def test_pack_puts_even_element_in_low_nibble():
    codes = torch.tensor([[0x1, 0x2, 0xF, 0x0, 0x7, 0x9]], dtype=torch.uint8)
    assert pack_e2m1(codes).tolist() == [[0x21, 0x0F, 0x97]]
    assert unpack_e2m1(pack_e2m1(codes)).tolist() == codes.tolist()


def test_pack_round_trips_all_byte_values():
    packed = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    codes = unpack_e2m1(packed)
    assert codes.shape == (16, 32)
    assert codes[3, :2].tolist() == [0, 3]  # byte 0x30: low nibble 0 first, then high nibble 3
    assert torch.equal(pack_e2m1(codes), packed)


def test_pack_rejects_odd_length():
    with pytest.raises(ValueError):
        pack_e2m1(torch.zeros(3, dtype=torch.uint8))
