//! Arrays travel as msgpack `bin` values holding little-endian raw bytes, so the Python side can
//! view them with `numpy.frombuffer` without a copy and the Rust side needs no per-element
//! msgpack framing.

use serde_bytes::ByteBuf;

#[derive(Debug, thiserror::Error)]
#[error("array `{field}`: {len} bytes is not a whole number of {elem}-byte elements")]
pub struct ArrayError {
    pub field: &'static str,
    pub len: usize,
    pub elem: usize,
}

/// A fixed-width number that can be packed into / unpacked from little-endian bytes.
pub trait LeArray: Sized + Copy {
    const WIDTH: usize;
    fn put(self, out: &mut Vec<u8>);
    fn get(bytes: &[u8]) -> Self;

    fn to_bin(values: &[Self]) -> ByteBuf {
        let mut out = Vec::with_capacity(values.len() * Self::WIDTH);
        for v in values {
            v.put(&mut out);
        }
        ByteBuf::from(out)
    }

    fn from_bin(field: &'static str, bytes: &[u8]) -> Result<Vec<Self>, ArrayError> {
        if !bytes.len().is_multiple_of(Self::WIDTH) {
            return Err(ArrayError {
                field,
                len: bytes.len(),
                elem: Self::WIDTH,
            });
        }
        Ok(bytes.chunks_exact(Self::WIDTH).map(Self::get).collect())
    }
}

macro_rules! le_array {
    ($t:ty, $w:expr) => {
        impl LeArray for $t {
            const WIDTH: usize = $w;
            #[inline]
            fn put(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
            #[inline]
            fn get(bytes: &[u8]) -> Self {
                <$t>::from_le_bytes(bytes.try_into().expect("chunk of exact width"))
            }
        }
    };
}

le_array!(u8, 1);
le_array!(i32, 4);
le_array!(u32, 4);
le_array!(u64, 8);
le_array!(f32, 4);
