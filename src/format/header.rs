//! A GGUF header, already checked by [`super::gguf::validate`], decoded from memory into the
//! form candle's loader takes (`gguf_file::Content`): what candle's own `Content::read` makes
//! of the same bytes, value for value, somewhat faster. candle reads through a cursor one field
//! at a time and copies every string twice; here each string is one allocation. Gemma 3's
//! header (262,144 token strings, scores and types): 21-38 ms with candle's reader, 18-32 with
//! this one (Zen 4), about 15 ms of a 0.27 s start. Allocating its 800,000 values bounds both.

use std::collections::HashMap;

use anyhow::{anyhow, bail, Result};
use candle_core::quantized::gguf_file::{Content, TensorInfo, Value, VersionedMagic};

use super::gguf::candle_dtype;

/// candle's alignment of the tensor data when the file names none.
const DEFAULT_ALIGNMENT: u64 = 32;

/// The header (magic through tensor index) as candle's `Content::read` decodes it: strings
/// lose trailing NULs and invalid UTF-8 becomes U+FFFD, dimensions are reversed, the data
/// starts at the next multiple of `general.alignment` (a non-negative integer of up to 32
/// bits, else 32). A type candle does not know is an error, as it is there.
pub fn content(header: &[u8]) -> Result<Content> {
    let mut r = Bytes { b: header, pos: 0 };
    if r.take(4)? != b"GGUF" {
        bail!("no GGUF magic");
    }
    let magic = match r.u32()? {
        2 => VersionedMagic::GgufV2,
        3 => VersionedMagic::GgufV3,
        v => bail!("GGUF version {v} is not read here"),
    };
    let tensors = r.u64()?;
    let kvs = r.u64()?;
    let mut metadata = HashMap::with_capacity(kvs.min(1 << 16) as usize);
    for _ in 0..kvs {
        let key = r.string()?;
        let ty = r.u32()?;
        let value = r.value(ty, 0)?;
        metadata.insert(key, value);
    }
    let mut tensor_infos = HashMap::with_capacity(tensors.min(1 << 16) as usize);
    for _ in 0..tensors {
        let name = r.string()?;
        let n = r.u32()?;
        if n > 4 {
            bail!("tensor {name} has {n} dimensions");
        }
        let mut dims = (0..n)
            .map(|_| r.u64().map(|d| d as usize))
            .collect::<Result<Vec<_>>>()?;
        dims.reverse();
        let t = r.u32()?;
        let ggml_dtype =
            candle_dtype(t).ok_or_else(|| anyhow!("tensor {name} has ggml type {t}"))?;
        let offset = r.u64()?;
        let shape = candle_core::Shape::from(dims);
        tensor_infos.insert(
            name,
            TensorInfo {
                ggml_dtype,
                shape,
                offset,
            },
        );
    }
    let alignment = match metadata.get("general.alignment") {
        Some(Value::U8(v)) => *v as u64,
        Some(Value::U16(v)) => *v as u64,
        Some(Value::U32(v)) => *v as u64,
        Some(Value::I8(v)) if *v >= 0 => *v as u64,
        Some(Value::I16(v)) if *v >= 0 => *v as u64,
        Some(Value::I32(v)) if *v >= 0 => *v as u64,
        _ => DEFAULT_ALIGNMENT,
    };
    if alignment == 0 {
        bail!("general.alignment is 0");
    }
    let tensor_data_offset = (r.pos as u64).div_ceil(alignment) * alignment;
    Ok(Content {
        magic,
        metadata,
        tensor_infos,
        tensor_data_offset,
    })
}

/// A content as comparable text: the magic, every key and value and every tensor (name, type,
/// shape, offset), each list sorted, and where the data starts. Two decodings of a header are
/// the same exactly when these are.
pub fn canonical(c: &Content) -> String {
    let mut md: Vec<String> = c.metadata.iter().map(|kv| format!("{kv:?}")).collect();
    md.sort();
    let mut ts: Vec<String> = c
        .tensor_infos
        .iter()
        .map(|(n, t)| format!("{n} {:?} {:?} {}", t.ggml_dtype, t.shape, t.offset))
        .collect();
    ts.sort();
    format!(
        "{:?}\n{}\n{}\n{}",
        c.magic,
        md.join("\n"),
        ts.join("\n"),
        c.tensor_data_offset
    )
}

/// A cursor over the header's bytes; every read is bounds-checked.
struct Bytes<'a> {
    b: &'a [u8],
    pos: usize,
}

impl<'a> Bytes<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.b.len());
        let end = end.ok_or_else(|| anyhow!("header cut off at byte {}", self.pos))?;
        let s = &self.b[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn fixed<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn u32(&mut self) -> Result<u32> {
        self.fixed().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Result<u64> {
        self.fixed().map(u64::from_le_bytes)
    }

    fn string(&mut self) -> Result<String> {
        let n = usize::try_from(self.u64()?)?;
        let mut raw = self.take(n)?;
        while let [rest @ .., 0] = raw {
            raw = rest;
        }
        Ok(match std::str::from_utf8(raw) {
            Ok(s) => s.to_owned(),
            Err(_) => String::from_utf8_lossy(raw).into_owned(),
        })
    }

    /// One value of GGUF type `ty`, arrays nested at most 4 deep (as the validator allows).
    fn value(&mut self, ty: u32, depth: usize) -> Result<Value> {
        Ok(match ty {
            0 => Value::U8(self.fixed::<1>()?[0]),
            1 => Value::I8(i8::from_le_bytes(self.fixed()?)),
            2 => Value::U16(u16::from_le_bytes(self.fixed()?)),
            3 => Value::I16(i16::from_le_bytes(self.fixed()?)),
            4 => Value::U32(self.u32()?),
            5 => Value::I32(i32::from_le_bytes(self.fixed()?)),
            6 => Value::F32(f32::from_le_bytes(self.fixed()?)),
            7 => match self.fixed::<1>()?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => bail!("bool stored as {b}"),
            },
            8 => Value::String(self.string()?),
            9 if depth < 4 => {
                let elem = self.u32()?;
                let len = self.u64()?;
                // Each element takes at least a byte: a length past the header is an error
                // below, not an allocation here.
                let cap = usize::try_from(len)?.min(self.b.len() - self.pos);
                let mut vs = Vec::with_capacity(cap);
                for _ in 0..len {
                    vs.push(self.value(elem, depth + 1)?);
                }
                Value::Array(vs)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(i64::from_le_bytes(self.fixed()?)),
            12 => Value::F64(f64::from_le_bytes(self.fixed()?)),
            t => bail!("value type {t} at byte {}", self.pos),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A header with every value type, nested arrays, a string with trailing NULs and one
    /// with invalid UTF-8, an alignment of 64 and two tensors: candle's reader and this one
    /// give the same content.
    #[test]
    fn decodes_as_candle_does() {
        let mut h = Vec::new();
        let s = |h: &mut Vec<u8>, v: &[u8]| {
            h.extend((v.len() as u64).to_le_bytes());
            h.extend(v);
        };
        h.extend(b"GGUF");
        h.extend(3u32.to_le_bytes());
        h.extend(2u64.to_le_bytes());
        h.extend(15u64.to_le_bytes());
        let scalars: [(u32, &[u8]); 11] = [
            (0, &[200]),
            (1, &[0x9c]),
            (2, &[1, 2]),
            (3, &[0xff, 0xff]),
            (4, &[1, 0, 0, 1]),
            (5, &[0, 0, 0, 0x80]),
            (6, &[0, 0, 0xc0, 0x7f]),
            (7, &[1]),
            (10, &[1, 2, 3, 4, 5, 6, 7, 8]),
            (11, &[0xff; 8]),
            (12, &[0, 0, 0, 0, 0, 0, 0xf0, 0x3f]),
        ];
        for (i, (t, v)) in scalars.iter().enumerate() {
            s(&mut h, format!("k{i}").as_bytes());
            h.extend(t.to_le_bytes());
            h.extend(*v);
        }
        s(&mut h, b"str\0\0");
        h.extend(8u32.to_le_bytes());
        s(&mut h, b"nul-ended\0");
        s(&mut h, b"bad");
        h.extend(8u32.to_le_bytes());
        s(&mut h, &[b'a', 0xff, b'b']);
        s(&mut h, b"nested");
        h.extend(9u32.to_le_bytes());
        h.extend(9u32.to_le_bytes());
        h.extend(2u64.to_le_bytes());
        for n in [1u64, 2] {
            h.extend(8u32.to_le_bytes());
            h.extend(n.to_le_bytes());
            for _ in 0..n {
                s(&mut h, b"tok");
            }
        }
        s(&mut h, b"general.alignment");
        h.extend(4u32.to_le_bytes());
        h.extend(64u32.to_le_bytes());
        for (name, dims, t, off) in [
            ("a", vec![4u64, 3], 1u32, 0u64),
            ("b.weight", vec![32], 8, 64),
        ] {
            s(&mut h, name.as_bytes());
            h.extend((dims.len() as u32).to_le_bytes());
            for d in dims {
                h.extend(d.to_le_bytes());
            }
            h.extend(t.to_le_bytes());
            h.extend(off.to_le_bytes());
        }
        let ours = content(&h).unwrap();
        let theirs = Content::read(&mut std::io::Cursor::new(&h)).unwrap();
        assert_eq!(canonical(&ours), canonical(&theirs));
        assert_eq!(ours.metadata.len(), 15);
        assert_eq!(ours.tensor_data_offset % 64, 0);
        // Cut anywhere, it is an error, never a panic.
        for end in [3, 10, 30, h.len() / 2, h.len() - 1] {
            assert!(content(&h[..end]).is_err(), "cut at {end}");
        }
    }
}
