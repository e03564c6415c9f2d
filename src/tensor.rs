//! Data types, shapes and the byte buffers that carry tensors through the library.
//!
//! A request's input is copied once (or borrowed with a release callback); a batch output
//! is one shared buffer that every response of the batch points into with an offset.

use crate::status::{Error, Result};
use std::sync::Arc;

/// A tensor shape; inline for up to 4 dims.
pub type Shape = smallvec::SmallVec<[i64; 4]>;

/// Element type of a tensor. The numeric values are part of the C ABI.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum DataType {
    Invalid = 0,
    Bool = 1,
    Uint8 = 2,
    Uint16 = 3,
    Uint32 = 4,
    Uint64 = 5,
    Int8 = 6,
    Int16 = 7,
    Int32 = 8,
    Int64 = 9,
    Fp16 = 10,
    Fp32 = 11,
    Fp64 = 12,
    Bytes = 13,
    Bf16 = 14,
}

impl DataType {
    pub const ALL: [DataType; 15] = [
        DataType::Invalid,
        DataType::Bool,
        DataType::Uint8,
        DataType::Uint16,
        DataType::Uint32,
        DataType::Uint64,
        DataType::Int8,
        DataType::Int16,
        DataType::Int32,
        DataType::Int64,
        DataType::Fp16,
        DataType::Fp32,
        DataType::Fp64,
        DataType::Bytes,
        DataType::Bf16,
    ];

    pub fn from_u32(v: u32) -> Option<DataType> {
        DataType::ALL.get(v as usize).copied()
    }

    /// Size of one element in bytes; 0 for BYTES (variable length) and INVALID.
    pub fn byte_size(self) -> usize {
        match self {
            DataType::Invalid | DataType::Bytes => 0,
            DataType::Bool | DataType::Uint8 | DataType::Int8 => 1,
            DataType::Uint16 | DataType::Int16 | DataType::Fp16 | DataType::Bf16 => 2,
            DataType::Uint32 | DataType::Int32 | DataType::Fp32 => 4,
            DataType::Uint64 | DataType::Int64 | DataType::Fp64 => 8,
        }
    }

    pub fn as_str(self) -> &'static str {
        self.as_cstr().to_str().unwrap_or("INVALID")
    }

    pub fn as_cstr(self) -> &'static std::ffi::CStr {
        match self {
            DataType::Invalid => c"INVALID",
            DataType::Bool => c"BOOL",
            DataType::Uint8 => c"UINT8",
            DataType::Uint16 => c"UINT16",
            DataType::Uint32 => c"UINT32",
            DataType::Uint64 => c"UINT64",
            DataType::Int8 => c"INT8",
            DataType::Int16 => c"INT16",
            DataType::Int32 => c"INT32",
            DataType::Int64 => c"INT64",
            DataType::Fp16 => c"FP16",
            DataType::Fp32 => c"FP32",
            DataType::Fp64 => c"FP64",
            DataType::Bytes => c"BYTES",
            DataType::Bf16 => c"BF16",
        }
    }

    /// Parses "FP32", "TYPE_FP32"; "STRING" / "TYPE_STRING" are BYTES (Triton's config name).
    pub fn parse(s: &str) -> Option<DataType> {
        let s = s.strip_prefix("TYPE_").unwrap_or(s);
        if s == "STRING" {
            return Some(DataType::Bytes);
        }
        DataType::ALL[1..].iter().copied().find(|d| d.as_str() == s)
    }
}

/// Number of elements of a fully specified shape, or an error on negative dims or overflow.
pub fn element_count(shape: &[i64]) -> Option<usize> {
    let mut n: usize = 1;
    for &d in shape {
        if d < 0 {
            return None;
        }
        n = n.checked_mul(usize::try_from(d).ok()?)?;
    }
    Some(n)
}

/// Formats a shape as `[1,16]`.
pub fn shape_string(shape: &[i64]) -> String {
    let parts: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    format!("[{}]", parts.join(","))
}

/// Checks a BYTES buffer: a sequence of (u32 little-endian length, bytes) elements.
/// Returns the number of elements.
pub fn count_bytes_elements(data: &[u8]) -> Result<usize> {
    let mut pos = 0usize;
    let mut n = 0usize;
    while pos < data.len() {
        if data.len() - pos < 4 {
            return Err(Error::invalid(format!(
                "BYTES element {n} at byte {pos}: truncated length prefix"
            )));
        }
        let len =
            u32::from_le_bytes([data[pos], data[pos + 1], data[pos + 2], data[pos + 3]]) as usize;
        pos += 4;
        if data.len() - pos < len {
            return Err(Error::invalid(format!(
                "BYTES element {n}: length {len} runs past the end of the buffer"
            )));
        }
        pos += len;
        n += 1;
    }
    Ok(n)
}

/// Byte offsets of each element of a BYTES buffer (start of its length prefix) plus the end.
pub fn bytes_element_offsets(data: &[u8]) -> Vec<usize> {
    let mut offs = Vec::new();
    let mut pos = 0usize;
    while pos + 4 <= data.len() {
        offs.push(pos);
        let len =
            u32::from_le_bytes([data[pos], data[pos + 1], data[pos + 2], data[pos + 3]]) as usize;
        pos = pos.saturating_add(4).saturating_add(len).min(data.len());
    }
    offs.push(data.len());
    offs
}

/// Most dimensions a tensor may have (a shape with more is refused before it is read).
pub const MAX_DIMS: usize = 64;

/// A zeroed buffer of `n` bytes, or None when the allocator refuses. Like `vec![0; n]`
/// the pages are zeroed by the system as they are first touched, but a refusal is an
/// answer instead of an abort of the whole process.
pub fn try_zeroed(n: usize) -> Option<Vec<u8>> {
    if n == 0 {
        return Some(Vec::new());
    }
    let layout = std::alloc::Layout::array::<u8>(n).ok()?;
    // SAFETY: the layout's size is not zero (checked above).
    let p = unsafe { std::alloc::alloc_zeroed(layout) };
    if p.is_null() {
        return None;
    }
    // SAFETY: `p` comes from the global allocator with the layout of `n` bytes (align 1),
    // which is what a Vec<u8> of capacity `n` holds; all `n` bytes are initialised (0).
    Some(unsafe { Vec::from_raw_parts(p, n, n) })
}

/// Called once when the library no longer reads a borrowed input buffer (the
/// application's release callback, see `ffi`).
pub type Release = crate::callback::InlineFn<()>;

/// Bytes the caller lends to the library until `release` runs.
pub struct Borrowed {
    ptr: *const u8,
    len: usize,
    release: Option<Release>,
    /// The caller says the memory is page-locked (INFER_MEMORY_CPU_PINNED): a device
    /// may copy it directly.
    page_locked: bool,
}

// SAFETY: the caller promises (C API contract) that the memory stays valid and unchanged
// until release is called; the library only reads it.
unsafe impl Send for Borrowed {}
unsafe impl Sync for Borrowed {}

impl Borrowed {
    /// # Safety
    /// `ptr` must be valid for reads of `len` bytes until `release` is called.
    pub unsafe fn new(ptr: *const u8, len: usize, release: Option<Release>) -> Borrowed {
        Borrowed {
            ptr,
            len,
            release,
            page_locked: false,
        }
    }
    /// Marks the memory as page-locked, as the caller says it is.
    pub fn page_locked(mut self) -> Borrowed {
        self.page_locked = true;
        self
    }
    pub fn as_slice(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: guaranteed by the constructor's contract.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for Borrowed {
    fn drop(&mut self) {
        if let Some(r) = self.release.take() {
            r.call(());
        }
    }
}

/// Host bytes that several tensors share (the windows of a batch output): a vector, or
/// the page-locked buffer a GPU instance copied the output into, which goes back to its
/// pool when the last window is dropped.
pub type SharedBytes = Arc<dyn HostBytes>;

/// A buffer of host bytes behind [`SharedBytes`].
pub trait HostBytes: Send + Sync {
    fn bytes(&self) -> &[u8];
    /// Whether the bytes lie in page-locked memory (a device can copy them directly).
    fn page_locked(&self) -> bool {
        false
    }
}

impl HostBytes for Vec<u8> {
    fn bytes(&self) -> &[u8] {
        self
    }
}

impl HostBytes for crate::cuda::PinnedBuf {
    fn bytes(&self) -> &[u8] {
        self.as_slice()
    }
    fn page_locked(&self) -> bool {
        true
    }
}

/// Where a tensor's bytes live.
pub enum TensorData {
    Owned(Vec<u8>),
    Borrowed(Borrowed),
    /// A window into a buffer shared with other tensors (a batch output).
    Shared {
        buf: SharedBytes,
        offset: usize,
        len: usize,
    },
    /// Bytes in GPU memory: never read on the host (see [`TensorData::as_slice`]).
    Device(DeviceData),
}

/// A tensor in GPU memory: an input the caller lends, or a window into a batch output
/// the library keeps on the device.
pub struct DeviceData {
    pub ptr: u64,
    pub len: usize,
    pub device: i32,
    /// What keeps the memory valid.
    pub keep: DeviceKeep,
}

pub enum DeviceKeep {
    /// The caller's memory, released through its callback (if any) when dropped.
    Borrowed(#[allow(dead_code)] Option<Borrowed>),
    /// A batch output shared by the responses of a batch.
    Pooled(#[allow(dead_code)] Arc<crate::cuda::DeviceBuf>),
    /// The caller's memory, shared by the tensors of an ensemble's steps: released
    /// when the last of them is dropped.
    Shared(#[allow(dead_code)] Arc<Option<Borrowed>>),
}

impl TensorData {
    /// The bytes in host memory. Empty for [`TensorData::Device`]: code that may meet
    /// device data asks [`TensorData::device`] first (the scheduler copies device inputs
    /// to the host before any path that reads them there).
    pub fn as_slice(&self) -> &[u8] {
        match self {
            TensorData::Owned(v) => v,
            TensorData::Borrowed(b) => b.as_slice(),
            TensorData::Shared { buf, offset, len } => &buf.bytes()[*offset..*offset + *len],
            TensorData::Device(_) => &[],
        }
    }
    pub fn len(&self) -> usize {
        match self {
            TensorData::Owned(v) => v.len(),
            TensorData::Borrowed(b) => b.len,
            TensorData::Shared { len, .. } => *len,
            TensorData::Device(d) => d.len,
        }
    }
    /// The bytes, where they lie in page-locked host memory, which a device can copy
    /// from directly: an input the caller lent as such (INFER_MEMORY_CPU_PINNED), or a
    /// window of the buffer a GPU instance lent to a response (an ensemble passes its
    /// steps' outputs on this way).
    pub fn page_locked_bytes(&self) -> Option<&[u8]> {
        match self {
            TensorData::Borrowed(b) if b.page_locked => Some(b.as_slice()),
            TensorData::Shared { buf, offset, len } if buf.page_locked() => {
                Some(&buf.bytes()[*offset..*offset + *len])
            }
            _ => None,
        }
    }
    /// Whether the bytes are in host memory that is page-locked: an output a GPU
    /// instance lent its landing buffer to, or an input lent as such.
    pub fn in_page_locked_memory(&self) -> bool {
        self.page_locked_bytes().is_some()
    }
    /// The device memory, for data on a GPU.
    pub fn device(&self) -> Option<&DeviceData> {
        match self {
            TensorData::Device(d) => Some(d),
            _ => None,
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A named tensor: a request input or a response output.
pub struct Tensor {
    pub name: Arc<str>,
    pub dtype: DataType,
    pub shape: Shape,
    pub data: TensorData,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn datatype_names_round_trip() {
        for d in &DataType::ALL[1..] {
            assert_eq!(DataType::parse(d.as_str()), Some(*d));
            assert_eq!(DataType::parse(&format!("TYPE_{}", d.as_str())), Some(*d));
            assert_eq!(DataType::from_u32(*d as u32), Some(*d));
        }
        assert_eq!(DataType::parse("TYPE_STRING"), Some(DataType::Bytes));
        assert_eq!(DataType::parse("FLOAT"), None);
        assert_eq!(DataType::parse("INVALID"), None);
        assert_eq!(DataType::Bf16.byte_size(), 2);
        assert_eq!(DataType::Bytes.byte_size(), 0);
    }

    #[test]
    fn element_counts() {
        assert_eq!(element_count(&[2, 3]), Some(6));
        assert_eq!(element_count(&[]), Some(1));
        assert_eq!(element_count(&[2, -1]), None);
        assert_eq!(element_count(&[i64::MAX, 4]), None);
    }

    #[test]
    fn bytes_layout() {
        let mut b = Vec::new();
        for s in ["ab", "", "xyz"] {
            b.extend_from_slice(&(s.len() as u32).to_le_bytes());
            b.extend_from_slice(s.as_bytes());
        }
        assert_eq!(count_bytes_elements(&b).unwrap(), 3);
        assert_eq!(bytes_element_offsets(&b), vec![0, 6, 10, 17]);
        assert!(count_bytes_elements(&b[..b.len() - 1]).is_err());
        assert!(count_bytes_elements(&[1, 0]).is_err());
    }
}
