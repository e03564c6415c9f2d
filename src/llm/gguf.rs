//! Reading GGUF files (GGML's model format, versions 2 and 3): the metadata key-value
//! pairs and where each tensor's bytes are. The file is memory-mapped; tensors are
//! handed out as ranges of the mapping, never copied.
//!
//! A file is untrusted input: every length, count and offset is checked against the
//! file's size before use, strings and arrays have limits, tensors must lie one after
//! another as GGML writes them (so a changed type, shape or offset is caught rather
//! than read from another tensor's bytes), and a bad file is INVALID_ARGUMENT naming the
//! file and what is wrong — never a panic.

use super::linear::Bytes;
use super::quant::WeightType;
use crate::status::{Error, Result};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Value {
    Int(i64),
    UInt(u64),
    Float(f64),
    Bool(bool),
    Str(String),
    Array(Vec<Value>),
}

impl Value {
    pub(crate) fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::UInt(v) => Some(v),
            Value::Int(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub(crate) fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::Float(v) => Some(v),
            Value::UInt(v) => Some(v as f64),
            Value::Int(v) => Some(v as f64),
            _ => None,
        }
    }

    pub(crate) fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
}

/// Where a tensor is and what it holds. `dims` are GGML's, innermost first (a matrix
/// `[rows][cols]` is `[cols, rows]`).
#[derive(Clone, Debug)]
pub(crate) struct TensorInfo {
    pub dims: Vec<u64>,
    pub ggml_type: u32,
    /// Absolute offset in the file.
    pub start: usize,
    pub len: usize,
}

/// An opened GGUF file.
pub(crate) struct Gguf {
    pub path: String,
    map: Arc<memmap2::Mmap>,
    pub meta: HashMap<String, Value>,
    pub tensors: HashMap<String, TensorInfo>,
}

/// Longest string a file may hold (a chat template or a merge list entry is far less).
const MAX_STRING: u64 = 1 << 24;
/// Most elements of one metadata array (vocabularies are ~10^5 to 10^6).
const MAX_ARRAY: u64 = 1 << 24;
/// Most tensors and metadata entries.
const MAX_COUNT: u64 = 1 << 20;
const MAX_DIMS: u32 = 4;

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
    path: &'a str,
}

impl Reader<'_> {
    fn bad(&self, what: impl std::fmt::Display) -> Error {
        Error::invalid(format!(
            "{}: not a valid GGUF file: {what} (at byte {})",
            self.path, self.at
        ))
    }

    fn take(&mut self, n: usize) -> Result<&[u8]> {
        match self.at.checked_add(n) {
            Some(end) if end <= self.b.len() => {
                let s = &self.b[self.at..end];
                self.at = end;
                Ok(s)
            }
            _ => Err(self.bad(format!("{n} bytes needed past the end of the file"))),
        }
    }

    fn u32(&mut self) -> Result<u32> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self) -> Result<u64> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }

    fn string(&mut self) -> Result<String> {
        let n = self.u64()?;
        if n > MAX_STRING {
            return Err(self.bad(format!("a string of {n} bytes")));
        }
        let b = self.take(n as usize)?;
        String::from_utf8(b.to_vec()).map_err(|_| self.bad("a string that is not UTF-8"))
    }

    fn value(&mut self, ty: u32, depth: u32) -> Result<Value> {
        let v = match ty {
            0 => Value::UInt(self.take(1)?[0] as u64),
            1 => Value::Int(self.take(1)?[0] as i8 as i64),
            2 => {
                let b = self.take(2)?;
                Value::UInt(u16::from_le_bytes([b[0], b[1]]) as u64)
            }
            3 => {
                let b = self.take(2)?;
                Value::Int(i16::from_le_bytes([b[0], b[1]]) as i64)
            }
            4 => Value::UInt(self.u32()? as u64),
            5 => Value::Int(self.u32()? as i32 as i64),
            6 => Value::Float(f32::from_bits(self.u32()?) as f64),
            7 => match self.take(1)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(self.bad(format!("a boolean of value {b}"))),
            },
            8 => Value::Str(self.string()?),
            9 => {
                if depth > 2 {
                    return Err(self.bad("arrays nested too deep"));
                }
                let ety = self.u32()?;
                let n = self.u64()?;
                if n > MAX_ARRAY {
                    return Err(self.bad(format!("an array of {n} elements")));
                }
                // Each element takes at least a byte: a count past the file's end is bad.
                if n as usize > self.b.len() - self.at {
                    return Err(self.bad(format!("an array of {n} elements past the end")));
                }
                let mut a = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    a.push(self.value(ety, depth + 1)?);
                }
                Value::Array(a)
            }
            10 => Value::UInt(self.u64()?),
            11 => Value::Int(self.u64()? as i64),
            12 => Value::Float(f64::from_bits(self.u64()?)),
            t => return Err(self.bad(format!("metadata value type {t}"))),
        };
        Ok(v)
    }
}

impl Gguf {
    /// Maps and parses `path`.
    pub(crate) fn open(path: &Path) -> Result<Gguf> {
        let shown = path.display().to_string();
        let file = std::fs::File::open(path)
            .map_err(|e| Error::not_found(format!("{shown}: cannot open: {e}")))?;
        // SAFETY: the mapping is read-only and private to this process. A model file
        // must not be modified while it is loaded (as with any mapped model file, e.g.
        // llama.cpp's); truncating it under a running server is outside the contract.
        let map = unsafe { memmap2::Mmap::map(&file) }
            .map_err(|e| Error::invalid(format!("{shown}: cannot map: {e}")))?;
        Gguf::parse(Arc::new(map), shown)
    }

    fn parse(map: Arc<memmap2::Mmap>, path: String) -> Result<Gguf> {
        let mut r = Reader {
            b: &map,
            at: 0,
            path: &path,
        };
        if map.len() < 4 || &map[..4] != b"GGUF" {
            return Err(Error::invalid(format!(
                "{path}: not a GGUF file (no GGUF magic)"
            )));
        }
        r.at = 4;
        let version = r.u32()?;
        if !(2..=3).contains(&version) {
            return Err(Error::unsupported(format!(
                "{path}: GGUF version {version} (versions 2 and 3 are read)"
            )));
        }
        let n_tensors = r.u64()?;
        let n_kv = r.u64()?;
        if n_tensors > MAX_COUNT || n_kv > MAX_COUNT {
            return Err(r.bad(format!("{n_tensors} tensors and {n_kv} metadata entries")));
        }
        let mut meta = HashMap::new();
        for _ in 0..n_kv {
            let key = r.string()?;
            let ty = r.u32()?;
            let v = r.value(ty, 0)?;
            meta.insert(key, v);
        }
        let mut infos = Vec::with_capacity(n_tensors as usize);
        for _ in 0..n_tensors {
            let name = r.string()?;
            let nd = r.u32()?;
            if nd == 0 || nd > MAX_DIMS {
                return Err(r.bad(format!("tensor {name} has {nd} dimensions")));
            }
            let mut dims = Vec::with_capacity(nd as usize);
            for _ in 0..nd {
                dims.push(r.u64()?);
            }
            let ggml_type = r.u32()?;
            let offset = r.u64()?;
            infos.push((name, dims, ggml_type, offset));
        }
        let align = match meta.get("general.alignment") {
            None => 32,
            Some(v) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() && a <= 1 << 16 => a as usize,
                _ => return Err(r.bad(format!("general.alignment {v:?}"))),
            },
        };
        let data_start = r.at.next_multiple_of(align);
        let mut tensors = HashMap::new();
        // Tensors lie one after another in the order they are listed, each padded to the
        // alignment (as GGML writes them and its reader requires): where a tensor's
        // offset is not the previous one's end, the file is damaged (a changed type or
        // shape would have the kernels read another tensor's bytes). After a tensor of
        // a type this reader cannot size, the next offset is only checked for order.
        let mut expected = Some(0u64);
        let mut last = 0u64;
        let mut before = String::new();
        for (name, dims, ggml_type, offset) in infos {
            if !offset.is_multiple_of(align as u64) {
                return Err(r.bad(format!(
                    "tensor {name} at data offset {offset}, not a multiple of the alignment ({align})"
                )));
            }
            if offset < last {
                return Err(r.bad(format!(
                    "tensor {name} at data offset {offset}, before {before} ({last}) listed before it"
                )));
            }
            if let Some(e) = expected.filter(|&e| e != offset) {
                let prev = match before.as_str() {
                    "" => "the data section starts at 0".to_owned(),
                    b => format!("{b} before it ends at {e}"),
                };
                return Err(Error::invalid(format!(
                    "{path}: tensor {name} is at data offset {offset}, but {prev} (tensors follow one another, each padded to {align} bytes): a damaged file, or a changed type or shape?"
                )));
            }
            last = offset;
            before.clone_from(&name);
            let elems = dims
                .iter()
                .try_fold(1u64, |a, &d| a.checked_mul(d))
                .ok_or_else(|| r.bad(format!("tensor {name}: dims {dims:?} overflow")))?;
            let len = match WeightType::from_ggml(ggml_type) {
                Some(t) => {
                    let be = t.block_elems() as u64;
                    if dims[0] % be != 0 {
                        return Err(r.bad(format!(
                            "tensor {name}: rows of {} elements are not whole {} blocks",
                            dims[0],
                            t.name()
                        )));
                    }
                    (elems / be).checked_mul(t.block_bytes() as u64)
                }
                // Not computable here; its size is unknown, so it must not be used.
                None => Some(0),
            };
            let start = (data_start as u64).checked_add(offset);
            let (Some(len), Some(start)) = (len, start) else {
                return Err(r.bad(format!("tensor {name}: size or offset overflows")));
            };
            if start
                .checked_add(len)
                .is_none_or(|end| end > map.len() as u64)
            {
                return Err(Error::invalid(format!(
                    "{path}: tensor {name} ({len} bytes at {start}) runs past the end of the file ({} bytes): truncated?",
                    map.len()
                )));
            }
            if tensors.contains_key(&name) {
                return Err(r.bad(format!("tensor {name} appears twice")));
            }
            expected = match WeightType::from_ggml(ggml_type) {
                Some(_) => offset.checked_add(len.next_multiple_of(align as u64)),
                None => None,
            };
            tensors.insert(
                name,
                TensorInfo {
                    dims,
                    ggml_type,
                    start: start as usize,
                    len: len as usize,
                },
            );
        }
        // Only the last tensor's padding may follow it (a shrunken last tensor would
        // leave its bytes there).
        if let Some(end) = expected {
            let trailing = (map.len() as u64).saturating_sub(data_start as u64 + end);
            if !before.is_empty() && trailing > 0 {
                return Err(Error::invalid(format!(
                    "{path}: {trailing} bytes follow the last tensor ({before}) and its padding: a damaged file, or a changed type or shape?"
                )));
            }
        }
        Ok(Gguf {
            path,
            map,
            meta,
            tensors,
        })
    }

    /// A tensor's bytes, with its type (UNSUPPORTED naming the tensor and type when the
    /// type is not one libinfer computes).
    pub(crate) fn tensor(&self, name: &str) -> Result<(WeightType, &TensorInfo, Bytes)> {
        let info = self
            .tensors
            .get(name)
            .ok_or_else(|| Error::invalid(format!("{}: tensor {name} is missing", self.path)))?;
        let t = WeightType::from_ggml(info.ggml_type).ok_or_else(|| {
            Error::unsupported(format!(
                "{}: tensor {name} has type {} ({}); supported: F32, F16, BF16, Q8_0, Q4_0, Q5_0, Q4_K, Q6_K",
                self.path,
                WeightType::ggml_name(info.ggml_type),
                info.ggml_type
            ))
        })?;
        let bytes = Bytes::Mapped {
            map: Arc::clone(&self.map),
            start: info.start,
            len: info.len,
        };
        Ok((t, info, bytes))
    }

    pub(crate) fn get(&self, key: &str) -> Option<&Value> {
        self.meta.get(key)
    }

    /// A required unsigned integer.
    pub(crate) fn uint(&self, key: &str) -> Result<u64> {
        match self.meta.get(key) {
            None => Err(Error::invalid(format!(
                "{}: metadata {key} is missing",
                self.path
            ))),
            Some(v) => v.as_u64().ok_or_else(|| {
                Error::invalid(format!(
                    "{}: metadata {key} is {v:?}, not an unsigned integer",
                    self.path
                ))
            }),
        }
    }

    /// An optional number.
    pub(crate) fn float(&self, key: &str) -> Result<Option<f64>> {
        match self.meta.get(key) {
            None => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| {
                Error::invalid(format!(
                    "{}: metadata {key} is {v:?}, not a number",
                    self.path
                ))
            }),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::status::Code;

    /// Writes a GGUF v3 file with the given metadata and tensors (name, dims, type,
    /// bytes).
    pub(crate) fn write(
        path: &Path,
        meta: &[(&str, Value)],
        tensors: &[(&str, Vec<u64>, u32, Vec<u8>)],
    ) {
        fn put_str(o: &mut Vec<u8>, s: &str) {
            o.extend((s.len() as u64).to_le_bytes());
            o.extend(s.as_bytes());
        }
        fn put_value(o: &mut Vec<u8>, v: &Value) {
            match v {
                Value::UInt(x) => o.extend(x.to_le_bytes()),
                Value::Int(x) => o.extend(x.to_le_bytes()),
                Value::Float(x) => o.extend((*x as f32).to_le_bytes()),
                Value::Bool(b) => o.push(*b as u8),
                Value::Str(s) => put_str(o, s),
                Value::Array(a) => {
                    o.extend(type_of(&a[0]).to_le_bytes());
                    o.extend((a.len() as u64).to_le_bytes());
                    for x in a {
                        put_value(o, x);
                    }
                }
            }
        }
        fn type_of(v: &Value) -> u32 {
            match v {
                Value::UInt(_) => 10,
                Value::Int(_) => 11,
                Value::Float(_) => 6,
                Value::Bool(_) => 7,
                Value::Str(_) => 8,
                Value::Array(_) => 9,
            }
        }
        let mut o = b"GGUF".to_vec();
        o.extend(3u32.to_le_bytes());
        o.extend((tensors.len() as u64).to_le_bytes());
        o.extend((meta.len() as u64).to_le_bytes());
        for (k, v) in meta {
            put_str(&mut o, k);
            o.extend(type_of(v).to_le_bytes());
            put_value(&mut o, v);
        }
        let mut offset = 0u64;
        for (name, dims, ty, data) in tensors {
            put_str(&mut o, name);
            o.extend((dims.len() as u32).to_le_bytes());
            for d in dims {
                o.extend(d.to_le_bytes());
            }
            o.extend(ty.to_le_bytes());
            o.extend(offset.to_le_bytes());
            offset += (data.len() as u64).next_multiple_of(32);
        }
        o.resize(o.len().next_multiple_of(32), 0);
        for (_, _, _, data) in tensors {
            o.extend(data);
            o.resize(o.len().next_multiple_of(32), 0);
        }
        std::fs::write(path, o).unwrap();
    }

    /// Where tensor `name`'s type (4 bytes) and offset (8 bytes) are in a file `write`
    /// wrote: after its name, dimension count and dimensions.
    pub(crate) fn info_at(file: &[u8], name: &str, dims: usize) -> usize {
        let key = [&(name.len() as u64).to_le_bytes()[..], name.as_bytes()].concat();
        let at = file
            .windows(key.len())
            .position(|w| w == key)
            .expect("tensor name");
        at + key.len() + 4 + 8 * dims
    }

    #[test]
    fn tensors_out_of_place_are_refused() {
        let dir = std::env::temp_dir().join(format!("infer-gguf-place-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("m.gguf");
        let f32s = |n: u32| -> Vec<u8> { (0..n).flat_map(|i| (i as f32).to_le_bytes()).collect() };
        write(
            &p,
            &[("general.architecture", Value::Str("llama".into()))],
            &[
                ("a", vec![8], 0, f32s(8)),
                ("b", vec![32, 2], 0, f32s(64)),
                ("c", vec![4], 0, f32s(4)),
            ],
        );
        let good = std::fs::read(&p).unwrap();
        let g = Gguf::open(&p).unwrap();
        assert_eq!(g.tensor("c").unwrap().2.get(), &f32s(4)[..]);
        let (b_type, c_off) = (info_at(&good, "b", 2), info_at(&good, "c", 1) + 4);
        let c_at = u64::from_le_bytes(good[c_off..c_off + 8].try_into().unwrap());
        let open_with = |patch: &dyn Fn(&mut Vec<u8>)| {
            let mut f = good.clone();
            patch(&mut f);
            std::fs::write(&p, &f).unwrap();
            Gguf::open(&p)
        };
        let refused = |patch: &dyn Fn(&mut Vec<u8>), words: &[&str]| {
            let e = open_with(patch)
                .err()
                .expect("a damaged file must be refused");
            assert_eq!(e.code, Code::InvalidArgument, "{e}");
            for w in words {
                assert!(e.message.contains(w), "{w}: {e}");
            }
        };
        let set_type =
            |t: u32| move |f: &mut Vec<u8>| f[b_type..b_type + 4].copy_from_slice(&t.to_le_bytes());
        let set_c =
            |o: u64| move |f: &mut Vec<u8>| f[c_off..c_off + 8].copy_from_slice(&o.to_le_bytes());
        // b read as F16 or Q8_0 is shorter than its bytes: c is not where b ends.
        refused(&set_type(1), &["tensor c", "b before it ends at"]);
        refused(&set_type(8), &["tensor c", "b before it ends"]);
        // c moved past a gap, into b, or off the alignment.
        refused(&set_c(c_at + 32), &["tensor c", "damaged"]);
        refused(&set_c(c_at - 32), &["tensor c", "damaged"]);
        refused(&set_c(0), &["tensor c", "before b"]);
        refused(&set_c(c_at + 4), &["tensor c", "alignment"]);
        // After a tensor of a type this reader cannot size, the next is read where it says.
        let g = open_with(&set_type(15)).unwrap();
        assert_eq!(g.tensor("b").err().unwrap().code, Code::Unsupported);
        assert_eq!(g.tensor("c").unwrap().2.get(), &f32s(4)[..]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn reads_what_it_is_given_and_refuses_damage() {
        let dir = std::env::temp_dir().join(format!("infer-gguf-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("m.gguf");
        let w: Vec<u8> = (0..64u32).flat_map(|i| (i as f32).to_le_bytes()).collect();
        write(
            &p,
            &[
                ("general.architecture", Value::Str("llama".into())),
                ("llama.block_count", Value::UInt(2)),
                (
                    "x.list",
                    Value::Array(vec![Value::Str("a".into()), Value::Str("b".into())]),
                ),
            ],
            &[
                ("w", vec![8, 8], 0, w.clone()),
                ("q", vec![256, 1], 15, vec![0; 8]),
            ],
        );
        let g = Gguf::open(&p).unwrap();
        assert_eq!(
            g.get("general.architecture").unwrap().as_str(),
            Some("llama")
        );
        assert_eq!(g.uint("llama.block_count").unwrap(), 2);
        assert!(matches!(g.get("x.list"), Some(Value::Array(a)) if a.len() == 2));
        let (t, info, bytes) = g.tensor("w").unwrap();
        assert_eq!((t, info.dims.clone()), (WeightType::F32, vec![8, 8]));
        assert_eq!(bytes.get(), &w[..]);
        // An unsupported type is named when the tensor is used.
        let e = g.tensor("q").err().unwrap();
        assert_eq!(e.code, Code::Unsupported);
        assert!(e.message.contains("Q8_K"), "{e}");
        assert_eq!(g.tensor("nope").err().unwrap().code, Code::InvalidArgument);

        // Every truncation that loses a needed byte is refused, none panics (the
        // unsupported tensor's size is unknown, so only `w`'s bytes count).
        let full = std::fs::read(&p).unwrap();
        let needed = info.start + info.len;
        for cut in (0..needed).step_by(7) {
            std::fs::write(&p, &full[..cut]).unwrap();
            let e = Gguf::open(&p)
                .err()
                .expect("a truncated file must be refused");
            assert_eq!(e.code, Code::InvalidArgument, "cut at {cut}: {e}");
        }
        // Flipped bytes in the header never panic.
        for at in 4..120.min(full.len()) {
            let mut b = full.clone();
            b[at] ^= 0xff;
            std::fs::write(&p, &b).unwrap();
            let _ = Gguf::open(&p);
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
