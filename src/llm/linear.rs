//! Weight matrices of any [`WeightType`], held where they were loaded (a memory-mapped
//! file or owned bytes) or, for Q8_0 and Q4_K, packed once at load into panels of eight rows
//! (`quant::panel`), and the matrix product of a step's token rows with them.
//!
//! A matrix is `[rows][cols]`, one output per row (Hugging Face's `nn.Linear` layout,
//! GGUF's `[ne1][ne0]`), so each output is the dot product of one weight row with one
//! token row. An output's bits depend only on its weight row and token row (a panel
//! kernel's outputs are the row kernel's bits):
//! batching invariance (see `kernels`) holds by construction, and threads may split
//! the outputs any way.

use super::kernels::{par_rows, prefetch, prefetch_l2, prefetch_write_line, Exec};
use super::quant::panel::{self, Panel};
use super::quant::{self, ActKind, ActRow, DotFn, WeightType, Q8, Q8K};
use crate::status::{Error, Result};
use std::sync::Arc;

/// Bytes of weights: a range of a mapped file, or owned.
#[derive(Clone)]
pub(crate) enum Bytes {
    Mapped {
        map: Arc<memmap2::Mmap>,
        start: usize,
        len: usize,
    },
    Owned(Arc<Vec<u8>>),
}

impl Bytes {
    #[inline]
    pub(crate) fn get(&self) -> &[u8] {
        match self {
            Bytes::Mapped { map, start, len } => &map[*start..*start + *len],
            Bytes::Owned(v) => v,
        }
    }

    /// Whether the bytes live in a mapped file (not on the heap).
    pub(crate) fn is_mapped(&self) -> bool {
        matches!(self, Bytes::Mapped { .. })
    }

    /// Takes a mapped range's whole pages out of this process's resident memory (they
    /// read back from the file if touched again). Owned bytes stay as they are.
    fn release_resident(&self) {
        let Bytes::Mapped { map, start, len } = self else {
            return;
        };
        let page = page_size();
        let base = map.as_ptr() as usize;
        let first = (base + start).next_multiple_of(page) - base;
        let end = (base + start + len) / page * page - base;
        if end > first {
            // SAFETY: the map is read-only and private, and nothing writes the file
            // while a model uses it (the premise of mapping it at all): pages dropped
            // here read back as the same bytes from the file the next time they are
            // touched, so every slice borrowed from the map stays valid and unchanged.
            // The range is inside the map.
            let r = unsafe {
                map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, first, end - first)
            };
            // Only resident memory is at stake, never correctness.
            drop(r);
        }
    }
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
        n if n > 0 => n as usize,
        _ => 4096,
    }
}

/// A matrix's rows `0 .. rows / 8 * 8` as panels of eight rows, packed once at load
/// (`panel` explains the layout): Q8_0's, the file's size, and Q4_K's, 1.03x (see
/// [`run_panels`] for Q6_K).
enum Packed {
    Q4K(Vec<panel::Q4KPanel>),
    Q8_0(Vec<panel::Q8Panel>),
    /// Q8_0 where the fastest kernels are AVX2's and no weight is -128.
    Q8_0Sm(Vec<panel::Q8SmPanel>),
}

impl Packed {
    /// The panels of `data` (`rows` of `row_bytes`, `cols` columns), when the type has
    /// panels, this CPU runs them, and the shape allows; `None` otherwise.
    fn of(
        wtype: WeightType,
        rows: usize,
        cols: usize,
        row_bytes: usize,
        data: &[u8],
    ) -> Result<Option<Packed>> {
        /// The panels, or `None` where `fits` refuses one's eight rows.
        fn pack<P: Panel>(
            rows: usize,
            cols: usize,
            row_bytes: usize,
            data: &[u8],
            fits: impl Fn(&[&[u8]; 8]) -> bool + Sync,
        ) -> Result<Option<Vec<P>>> {
            let nb = cols / panel::PANEL_COLS;
            let n = rows / 8 * nb;
            let mut v: Vec<P> = Vec::new();
            v.try_reserve_exact(n)
                .map_err(|e| Error::exhausted(format!("cannot allocate {n} weight panels: {e}")))?;
            v.resize(n, P::default());
            // Every core packs its share of the panels (a load is otherwise one
            // thread's work; the pages stream from the file as they are read).
            let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
            let per = (rows / 8).div_ceil(threads).max(1) * nb;
            let refused = std::sync::atomic::AtomicBool::new(false);
            let pack_part = |first: usize, part: &mut [P]| {
                for (p, out) in part.chunks_exact_mut(nb).enumerate() {
                    let p = first + p;
                    let rows: [&[u8]; 8] = std::array::from_fn(|i| {
                        &data[(8 * p + i) * row_bytes..(8 * p + i + 1) * row_bytes]
                    });
                    if refused.load(std::sync::atomic::Ordering::Relaxed) || !fits(&rows) {
                        refused.store(true, std::sync::atomic::Ordering::Relaxed);
                        return;
                    }
                    P::pack(rows, out);
                }
            };
            std::thread::scope(|s| {
                let mut parts = v.chunks_mut(per).enumerate();
                let mine = parts.next();
                for (i, part) in parts {
                    std::thread::Builder::new()
                        .name("infer-pack".into())
                        .spawn_scoped(s, move || pack_part(i * per / nb, part))
                        .map_err(|e| {
                            Error::exhausted(format!("cannot start a thread to pack weights: {e}"))
                        })?;
                }
                if let Some((_, part)) = mine {
                    pack_part(0, part);
                }
                Ok::<(), Error>(())
            })?;
            Ok((!refused.into_inner()).then_some(v))
        }
        if rows < 8 || cols == 0 || !cols.is_multiple_of(panel::PANEL_COLS) || !panel::available() {
            return Ok(None);
        }
        let any = |_: &[&[u8]; 8]| true;
        Ok(match wtype {
            WeightType::Q4K => pack(rows, cols, row_bytes, data, any)?.map(Packed::Q4K),
            WeightType::Q8_0 => {
                // Sign and magnitude for AVX2, unless a weight of -128 (which has no
                // such form) turns up while packing.
                let sm = match panel::Isa::best() {
                    panel::Isa::Avx2 => {
                        let fits = |r: &[&[u8]; 8]| !r.iter().any(|r| panel::q8_0_has_min(r));
                        pack(rows, cols, row_bytes, data, fits)?.map(Packed::Q8_0Sm)
                    }
                    panel::Isa::AvxVnni | panel::Isa::Vnni | panel::Isa::Amx => None,
                };
                match sm {
                    Some(p) => Some(p),
                    None => pack(rows, cols, row_bytes, data, any)?.map(Packed::Q8_0),
                }
            }
            _ => None,
        })
    }

    fn bytes(&self) -> usize {
        match self {
            Packed::Q4K(v) => std::mem::size_of_val(v.as_slice()),
            Packed::Q8_0(v) => std::mem::size_of_val(v.as_slice()),
            Packed::Q8_0Sm(v) => std::mem::size_of_val(v.as_slice()),
        }
    }
}

/// A weight matrix `[rows][cols]` of one element type.
#[derive(Clone)]
pub(crate) struct Matrix {
    pub name: String,
    pub wtype: WeightType,
    pub rows: usize,
    pub cols: usize,
    row_bytes: usize,
    data: Bytes,
    /// The rows as panels, when packed at load; `data` then serves the rows past the
    /// last whole eight, and row reads (embedding lookups, dequantizing).
    packed: Option<Arc<Packed>>,
    dot: DotFn,
}

impl Matrix {
    /// INVALID_ARGUMENT naming the tensor when the bytes do not hold exactly
    /// `rows × cols` elements, or `cols` is not whole blocks of the type.
    pub(crate) fn new(
        name: &str,
        wtype: WeightType,
        rows: usize,
        cols: usize,
        data: Bytes,
    ) -> Result<Matrix> {
        let row_bytes = wtype.row_bytes(cols).ok_or_else(|| {
            Error::invalid(format!(
                "tensor {name}: rows of {cols} elements are not whole {} blocks of {}",
                wtype.name(),
                wtype.block_elems()
            ))
        })?;
        let want = row_bytes.checked_mul(rows);
        if want != Some(data.get().len()) {
            return Err(Error::invalid(format!(
                "tensor {name}: {} bytes, but {rows} x {cols} {} needs {}",
                data.get().len(),
                wtype.name(),
                want.map_or("more than memory".into(), |w| w.to_string())
            )));
        }
        Ok(Matrix {
            name: name.to_string(),
            wtype,
            rows,
            cols,
            row_bytes,
            data,
            packed: None,
            dot: quant::dot_fn(wtype),
        })
    }

    /// The matrix ready for products: its rows packed into panels where that pays
    /// (Q8_0 and Q4_K with whole 256-column blocks, on a CPU with AVX2), and the file's pages
    /// they were packed from released. Other matrices come back as they are. A table
    /// only looked up by row (an untied token embedding) is not worth packing.
    pub(crate) fn packed(mut self) -> Result<Matrix> {
        if self.packed.is_none() {
            let packed = Packed::of(
                self.wtype,
                self.rows,
                self.cols,
                self.row_bytes,
                self.data.get(),
            )
            .map_err(|e| e.context(format!("tensor {}", self.name)))?;
            if let Some(p) = packed {
                self.data.release_resident();
                self.packed = Some(Arc::new(p));
            }
        }
        Ok(self)
    }

    /// F32 values, owned (for random models and tests).
    pub(crate) fn from_f32(name: &str, rows: usize, cols: usize, v: &[f32]) -> Result<Matrix> {
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        Matrix::new(
            name,
            WeightType::F32,
            rows,
            cols,
            Bytes::Owned(Arc::new(bytes)),
        )
    }

    #[inline]
    pub(crate) fn row(&self, r: usize) -> &[u8] {
        &self.data.get()[r * self.row_bytes..(r + 1) * self.row_bytes]
    }

    /// The whole matrix as f32, `[rows][cols]`.
    pub(crate) fn to_f32(&self) -> Vec<f32> {
        let mut v = vec![0.0; self.rows * self.cols];
        for (r, row) in v.chunks_exact_mut(self.cols.max(1)).enumerate() {
            self.row_f32(r, row);
        }
        v
    }

    /// Row `r` as f32 (an embedding lookup).
    pub(crate) fn row_f32(&self, r: usize, out: &mut [f32]) {
        quant::dequantize_row(self.wtype, self.row(r), &mut out[..self.cols]);
    }

    /// Bytes the weights take in memory: the panels when packed (and the rows past
    /// the last whole eight), else the file's bytes.
    pub(crate) fn bytes(&self) -> usize {
        match &self.packed {
            Some(p) => p.bytes() + (self.rows % 8) * self.row_bytes,
            None => self.data.get().len(),
        }
    }

    /// Whether the rows are packed into panels ([`Matrix::packed`]).
    pub(crate) fn is_packed(&self) -> bool {
        self.packed.is_some()
    }

    /// Whether the weights are computed from a mapped file (not packed into memory).
    pub(crate) fn is_mapped(&self) -> bool {
        self.packed.is_none() && self.data.is_mapped()
    }
}

/// A step's token rows (`[t][k]` f32), prepared once for every weight type that will
/// multiply them: the f32 rows themselves and, when needed, their 8-bit forms.
#[derive(Default)]
pub(crate) struct Acts {
    t: usize,
    k: usize,
    q8: Vec<Q8>,
    q8k: Vec<Q8K>,
    has_q8: bool,
    has_q8k: bool,
}

impl Acts {
    /// Prepares `x` (`t` rows of `k`) for the weight types in `types`. Rows are
    /// quantized on the pool's threads when there are many.
    pub(crate) fn prepare(
        &mut self,
        exec: Exec<'_>,
        x: &[f32],
        t: usize,
        k: usize,
        types: impl IntoIterator<Item = WeightType>,
    ) -> Result<()> {
        self.t = t;
        self.k = k;
        self.has_q8 = false;
        self.has_q8k = false;
        for ty in types {
            match ty.act() {
                ActKind::F32 => {}
                ActKind::Q8 if !self.has_q8 => {
                    let per = k / 32;
                    grow(&mut self.q8, t * per)?;
                    let q8 = &mut self.q8[..t * per];
                    par_rows(exec, t * k, q8, per, |r, out| {
                        quant::quantize_q8(&x[r * k..(r + 1) * k], out)
                    });
                    self.has_q8 = true;
                }
                ActKind::Q8K if !self.has_q8k => {
                    let per = k / 256;
                    grow(&mut self.q8k, t * per)?;
                    let q8k = &mut self.q8k[..t * per];
                    par_rows(exec, t * k, q8k, per, |r, out| {
                        quant::quantize_q8k(&x[r * k..(r + 1) * k], out)
                    });
                    self.has_q8k = true;
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// [`Acts::prepare`] of rows that `fill(r, row)` computes first, in the same pass:
    /// each thread part fills its token rows of `x` (`t` rows of `k`) and quantizes
    /// them while they are in cache. A step's norms and activations end in one wait
    /// for the pool, where a pass of their own and then [`Acts::prepare`] took two and
    /// read `x` twice (the 2,048 token rows of a long step are 32 MiB of gate values).
    /// The rows and their 8-bit forms are the same bits as from the two passes.
    pub(crate) fn fill_and_prepare(
        &mut self,
        exec: Exec<'_>,
        x: &mut [f32],
        t: usize,
        k: usize,
        types: impl IntoIterator<Item = WeightType>,
        fill: impl Fn(usize, &mut [f32]) + Sync,
    ) -> Result<()> {
        let (mut q8, mut q8k) = (false, false);
        for ty in types {
            match ty.act() {
                ActKind::Q8 => q8 = true,
                ActKind::Q8K => q8k = true,
                ActKind::F32 => {}
            }
        }
        let (p8, p8k) = (if q8 { k / 32 } else { 0 }, if q8k { k / 256 } else { 0 });
        grow(&mut self.q8, t * p8)?;
        grow(&mut self.q8k, t * p8k)?;
        (self.t, self.k, self.has_q8, self.has_q8k) = (t, k, q8, q8k);
        if k == 0 {
            return Ok(());
        }
        let rows = |first: usize, x: &mut [f32], q8: &mut [Q8], q8k: &mut [Q8K]| {
            for (i, row) in x.chunks_exact_mut(k).enumerate() {
                fill(first + i, row);
                if p8 > 0 {
                    quant::quantize_q8(row, &mut q8[i * p8..(i + 1) * p8]);
                }
                if p8k > 0 {
                    quant::quantize_q8k(row, &mut q8k[i * p8k..(i + 1) * p8k]);
                }
            }
        };
        let (x, q8, q8k) = (
            &mut x[..t * k],
            &mut self.q8[..t * p8],
            &mut self.q8k[..t * p8k],
        );
        let parts = exec.parts(t * k * 4, t);
        match exec.pool {
            Some(pool) if parts > 1 => {
                // Runs of whole rows, 4 parts a thread (a thread that finishes early
                // takes another).
                let per = t.div_ceil((parts * 4).min(t));
                let (mut x, mut q8, mut q8k) = (x, q8, q8k);
                let mut items = Vec::with_capacity(t.div_ceil(per));
                for first in (0..t).step_by(per) {
                    let n = per.min(t - first);
                    let (a, rest) = std::mem::take(&mut x).split_at_mut(n * k);
                    let (b, rest8) = std::mem::take(&mut q8).split_at_mut(n * p8);
                    let (c, rest8k) = std::mem::take(&mut q8k).split_at_mut(n * p8k);
                    (x, q8, q8k) = (rest, rest8, rest8k);
                    items.push((first, a, b, c));
                }
                pool.for_each(items, |(first, x, a, b)| rows(first, x, a, b));
            }
            _ => rows(0, x, q8, q8k),
        }
        Ok(())
    }

    /// The bytes of one prepared token row of `kind`.
    fn row_bytes(&self, kind: ActKind) -> usize {
        match kind {
            ActKind::F32 => self.k * size_of::<f32>(),
            ActKind::Q8 => self.k / 32 * size_of::<Q8>(),
            ActKind::Q8K => self.k / 256 * size_of::<Q8K>(),
        }
        .max(1)
    }

    #[inline]
    fn row<'a>(&'a self, kind: ActKind, x: &'a [f32], r: usize) -> ActRow<'a> {
        let k = self.k;
        match kind {
            ActKind::F32 => ActRow::F32(&x[r * k..(r + 1) * k]),
            ActKind::Q8 => {
                let per = k / 32;
                ActRow::Q8(&self.q8[r * per..(r + 1) * per])
            }
            ActKind::Q8K => {
                let per = k / 256;
                ActRow::Q8K(&self.q8k[r * per..(r + 1) * per])
            }
        }
    }
}

fn grow<T: Default + Clone>(v: &mut Vec<T>, n: usize) -> Result<()> {
    if v.len() < n {
        v.try_reserve(n - v.len()).map_err(|e| {
            Error::exhausted(format!("decoder step: cannot allocate activations: {e}"))
        })?;
        v.resize(n, T::default());
    }
    Ok(())
}

/// What happens to each output after its dot product.
#[derive(Clone, Copy)]
pub(crate) enum Out<'a> {
    /// `y = w·x`.
    Set,
    /// `y = w·x + bias`.
    Bias(&'a [f32]),
    /// `y += w·x` (a residual connection: `y` already holds the residual stream).
    Add,
    /// `y += w·x + bias`.
    BiasAdd(&'a [f32]),
}

/// A pointer to the output that pool threads write at disjoint places.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: each thread writes only the outputs of its own weight rows (disjoint columns
// of every token row), and all finish before `matmul` returns (the pool waits for them).
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    #[inline(always)]
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// Weight rows per tile, the unit the threads share out.
const TILE: usize = 16;
/// The most token rows a weight row meets per kernel call.
const TOKENS: usize = 32;

/// How `matmul` walks the product, in bytes of cache each level may fill.
#[derive(Clone, Copy)]
pub(crate) struct Blocking {
    /// Prepared activations of a token group: the group stays in the L1 cache while
    /// each weight row of a block meets it.
    pub group_bytes: usize,
    /// Weight rows of a block: the block stays in the L2 cache while every token group
    /// meets it, so that weights and activations are each read from memory once a block.
    pub block_bytes: usize,
}

impl Blocking {
    pub(crate) const DEFAULT: Blocking = Blocking {
        group_bytes: 16 << 10,
        block_bytes: 192 << 10,
    };
}

/// `y[i][j] (op)= w.row(j) · x[i]` for `i < t`, `j < w.rows`: `x` is `[t][w.cols]`
/// (prepared in `acts` for `w`'s type), `y` holds token rows `ldy` apart, this matrix's
/// outputs at columns `0..w.rows` of each.
pub(crate) fn matmul(
    exec: Exec<'_>,
    w: &Matrix,
    acts: &Acts,
    x: &[f32],
    y: &mut [f32],
    ldy: usize,
    out: Out<'_>,
) {
    matmuls(
        exec,
        &[(w, 0, 0, out)],
        acts,
        x,
        &mut [Target { y, ldy }],
        Blocking::DEFAULT,
    )
}

/// Where [`matmuls`] writes: token rows `ldy` apart in `y`.
pub(crate) struct Target<'a> {
    pub y: &'a mut [f32],
    pub ldy: usize,
}

/// One matrix of [`matmuls`]: its outputs go to this target, from this column of each
/// token row on.
pub(crate) type Product<'a> = (&'a Matrix, usize, usize, Out<'a>);

/// Several matrices with the same input, at once: for each `(w, target, col, out)`,
/// `targets[target].y[i][col + j] (op)= w.row(j) · x[i]`. The threads share out the
/// rows of all of them in one go, so that one wait ends the lot (a decode step's
/// products are short, and each wait for the pool costs about as much as one). The
/// matrices' output columns in one target must not overlap. Each output is the same
/// bits as [`matmul`] gives.
pub(crate) fn matmuls(
    exec: Exec<'_>,
    products: &[Product<'_>],
    acts: &Acts,
    x: &[f32],
    targets: &mut [Target<'_>],
    blocking: Blocking,
) {
    let (t, k) = (acts.t, acts.k);
    assert!(x.len() >= t * k);
    for &(w, target, col, out) in products {
        assert_eq!(
            k, w.cols,
            "{}: activations prepared for another width",
            w.name
        );
        let (n, Target { y, ldy }) = (w.rows, &targets[target]);
        assert!(*ldy >= col + n && (t == 0 || y.len() >= (t - 1) * ldy + col + n));
        if let Out::Bias(b) | Out::BiasAdd(b) = out {
            assert!(b.len() >= n);
        }
        match w.wtype.act() {
            ActKind::Q8 => assert!(acts.has_q8, "{}: activations not quantized", w.name),
            ActKind::Q8K => assert!(acts.has_q8k, "{}: activations not quantized", w.name),
            ActKind::F32 => {}
        }
    }
    for (a, pa) in products.iter().enumerate() {
        for pb in &products[a + 1..] {
            assert!(
                pa.1 != pb.1 || pa.2 + pa.0.rows <= pb.2 || pb.2 + pb.0.rows <= pa.2,
                "{} and {}: output columns overlap",
                pa.0.name,
                pb.0.name
            );
        }
    }
    let ys: Vec<(OutPtr, usize)> = targets
        .iter_mut()
        .map(|t| (OutPtr(t.y.as_mut_ptr()), t.ldy))
        .collect();
    // The tiles of every matrix in turn: product `p` holds tiles `starts[p]..starts[p + 1]`.
    let mut starts = Vec::with_capacity(products.len() + 1);
    starts.push(0);
    for &(w, ..) in products {
        starts.push(starts[starts.len() - 1] + w.rows.div_ceil(TILE));
    }
    let tiles = starts[products.len()];
    if t == 0 || tiles == 0 {
        return;
    }
    let work: usize = products.iter().map(|p| t * p.0.rows * k).sum();
    // With several tokens, more parts than threads: a thread that finishes early (or one
    // the host preempted) takes another part instead of waiting at the end, where the
    // other waits for about half a part (with 4 parts a thread, 3 % of 32 streams'
    // decoding). One token's product is too short for that to pay.
    let parts = match exec.parts(work, tiles) {
        p if p > 1 && t >= 4 => (p * PARTS_PER_THREAD).min(tiles),
        p => p,
    };
    let per = tiles.div_ceil(parts);
    let rows_of: Vec<Vec<ActRow<'_>>> = products
        .iter()
        .map(|&(w, ..)| (0..t).map(|i| acts.row(w.wtype.act(), x, i)).collect())
        .collect();
    let run = |part: usize| {
        let mine = (part * per).min(tiles)..((part + 1) * per).min(tiles);
        // The part's tiles of each matrix, as rows `first..end`.
        for (p, &(w, target, col, out)) in products.iter().enumerate() {
            let (s, e) = (mine.start.max(starts[p]), mine.end.min(starts[p + 1]));
            if s >= e {
                continue;
            }
            let (first, end) = ((s - starts[p]) * TILE, ((e - starts[p]) * TILE).min(w.rows));
            let (yp, ldy) = ys[target];
            let group = group_rows(w, acts, blocking);
            let block = (blocking.block_bytes / w.row_bytes).max(TILE) / TILE * TILE;
            run_rows(
                w,
                &rows_of[p],
                first..end,
                group,
                block,
                |i, r, v: &[f32]| {
                    // SAFETY: outputs `r..r + v.len()` of token `i` are inside the target
                    // (asserted above), and only the part that owns those rows of this matrix
                    // touches them (the matrices' columns in a target do not overlap), so
                    // this is the only reference to them while it lives.
                    let o = unsafe {
                        std::slice::from_raw_parts_mut(yp.get().add(i * ldy + col + r), v.len())
                    };
                    // The line of this token's next outputs of the matrix, written after
                    // the next kernel call: owned by then, not fetched at the store (a
                    // token's outputs are a row of their own, `ldy` apart, so the stores
                    // of a call go to as many lines as it has tokens).
                    if r + 2 * v.len() <= w.rows {
                        prefetch_write_line(o.as_ptr().wrapping_add(v.len()));
                    }
                    store(o, v, out, r);
                },
            );
        }
    };
    match exec.pool {
        Some(pool) if parts > 1 => pool.run(parts, &run),
        _ => (0..parts).for_each(run),
    }
}

/// Token rows of a group for `w`: as many prepared activation rows as
/// `blocking.group_bytes` holds, in fours, from the rows a kernel call takes to
/// [`TOKENS`]. The AVX-512 VNNI pair kernels of Q4_K, Q6_K and Q8_0 take 8 rows a call
/// where there are (their weights' shared work then serves twice the multiplies: 5-19 %
/// faster for 4,096 columns, where 4 rows fill the bytes), so their groups hold 8 at
/// least.
fn group_rows(w: &Matrix, acts: &Acts, blocking: Blocking) -> usize {
    if on_tiles(w) {
        return TOKENS;
    }
    let least = panel::rows_per_call(w.wtype, panel::Isa::best());
    (blocking.group_bytes / acts.row_bytes(w.wtype.act())).clamp(least, TOKENS) & !3
}

/// Whether `w`'s products of 8 or more token rows run on AMX tiles (Q8_0 packed at load,
/// where [`panel::Isa::best`] is AMX): those take token groups of [`TOKENS`] (two tiles'
/// rows), whatever their size. The tiles read a block of each token row at a time,
/// from the L2 cache as much as from L1, and a kernel call's fixed work (its tile
/// configuration, the weights' tiles) is then shared by more tokens.
fn on_tiles(w: &Matrix) -> bool {
    matches!(w.packed.as_deref(), Some(Packed::Q8_0(_))) && panel::Isa::best() == panel::Isa::Amx
}

/// `o (op)= v` as `out` says, for outputs `r..` of a matrix. A pair kernel call's 16
/// outputs of a token and a panel's 8 take arms of their own, where the length is a
/// constant and the copy compiles to a few vector moves (a slice's copy of 64 bytes is
/// otherwise a call to `memcpy`, about as long as the rest of the loop around the
/// kernel).
#[inline(always)]
fn store(o: &mut [f32], v: &[f32], out: Out<'_>, r: usize) {
    #[inline(always)]
    fn apply(o: &mut [f32], v: &[f32], out: Out<'_>, r: usize) {
        match out {
            Out::Set => o.copy_from_slice(v),
            Out::Bias(b) => {
                for ((o, &v), &b) in o.iter_mut().zip(v).zip(&b[r..]) {
                    *o = v + b;
                }
            }
            Out::Add => o.iter_mut().zip(v).for_each(|(o, &v)| *o += v),
            Out::BiasAdd(b) => {
                for ((o, &v), &b) in o.iter_mut().zip(v).zip(&b[r..]) {
                    *o += v + b;
                }
            }
        }
    }
    match (o.len(), v.len()) {
        (32, 32) => apply(&mut o[..32], &v[..32], out, r),
        (16, 16) => apply(&mut o[..16], &v[..16], out, r),
        (8, 8) => apply(&mut o[..8], &v[..8], out, r),
        _ => apply(o, v, out, r),
    }
}

/// Rows `rows` of `w` against every token row of `acts`, in blocks of `block` weight
/// rows (for L2) and groups of `group` token rows (for L1); `put(token, first row,
/// values)` takes a token's outputs of up to a tile of rows side by side (written as
/// whole vectors, not one value at a time `ldy` apart).
#[inline]
fn run_rows(
    w: &Matrix,
    acts: &[ActRow<'_>],
    rows: std::ops::Range<usize>,
    group: usize,
    block: usize,
    put: impl Fn(usize, usize, &[f32]),
) {
    match w.packed.as_deref() {
        Some(Packed::Q4K(p)) => {
            return run_panels(w, acts, rows, group, block, Panels::Packed(p), put)
        }
        Some(Packed::Q8_0(p)) => {
            return run_panels(w, acts, rows, group, block, Panels::Packed(p), put)
        }
        Some(Packed::Q8_0Sm(p)) => {
            return run_panels(w, acts, rows, group, block, Panels::Packed(p), put)
        }
        None => {}
    }
    if acts.len() >= PANEL_TOKENS && w.cols.is_multiple_of(panel::PANEL_COLS) && panel::available()
    {
        match w.wtype {
            WeightType::Q4K => {
                return Q4K_PANELS.with(|p| {
                    let scratch = &mut p.borrow_mut();
                    run_panels(w, acts, rows, group, block, Panels::PerCall(scratch), put)
                })
            }
            WeightType::Q6K => {
                return Q6K_PANELS.with(|p| {
                    let scratch = &mut p.borrow_mut();
                    run_panels(w, acts, rows, group, block, Panels::PerCall(scratch), put)
                })
            }
            _ => {}
        }
    }
    // A row's products with the group, then the tile's as `[token][row]`.
    let mut dots = [0.0f32; TOKENS];
    let mut tile = [0.0f32; TOKENS * TILE];
    let mut b0 = rows.start;
    while b0 < rows.end {
        let b1 = (b0 + block).min(rows.end);
        for i0 in (0..acts.len()).step_by(group) {
            let group = &acts[i0..(i0 + group).min(acts.len())];
            let g = group.len();
            for r0 in (b0..b1).step_by(TILE) {
                let r1 = (r0 + TILE).min(b1);
                for r in r0..r1 {
                    (w.dot)(w.row(r), group, &mut dots[..g]);
                    for (j, &d) in dots[..g].iter().enumerate() {
                        tile[j * TILE + r - r0] = d;
                    }
                }
                for (j, i) in (i0..i0 + g).enumerate() {
                    put(i, r0, &tile[j * TILE..j * TILE + r1 - r0]);
                }
            }
        }
        b0 = b1;
    }
}

/// Parts a thread of a product of 4 or more tokens is split into (see [`matmuls`]):
/// decoding 32 Q8_0 streams on 2 threads, steps with 12 (and the outputs' lines
/// prefetched) ran 1.08x faster than with 4.
const PARTS_PER_THREAD: usize = 12;

/// The fewest token rows in a group for which [`run_panels`] runs two panels at once.
const PAIR_TOKENS: usize = 4;

/// The fewest token rows for which a product packs Q4_K or Q6_K rows into panels per
/// call: packing costs about as much as a few tokens' products, and a panel's product
/// is about twice as fast.
const PANEL_TOKENS: usize = 4;

thread_local! {
    /// A thread's panels of the block of Q4_K or Q6_K rows it is working on (matrices
    /// not packed at load).
    static Q4K_PANELS: std::cell::RefCell<Vec<panel::Q4KPanel>> = const { std::cell::RefCell::new(Vec::new()) };
    static Q6K_PANELS: std::cell::RefCell<Vec<panel::Q6KPanel>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Where [`run_panels`] finds a block's panels.
enum Panels<'a, P> {
    /// The matrix's, packed at load (all whole eights of rows).
    Packed(&'a [P]),
    /// Packed into this scratch, a block at a time.
    PerCall(&'a mut Vec<P>),
}

/// [`run_rows`] through panels (Q8_0 and Q4_K packed at load; Q6_K packed per call, a
/// block of rows at a time, for 4 or more token rows): each block of rows meets every
/// token group; rows past the last whole eight use the row kernel (the same bits).
///
/// Q6_K's panels unpack its weights (1.7x the file's bytes), which would slow
/// memory-bound single-stream decoding, so Q6_K matrices stay in the file and are
/// packed per call.
fn run_panels<P: Panel>(
    w: &Matrix,
    acts: &[ActRow<'_>],
    rows: std::ops::Range<usize>,
    group: usize,
    block: usize,
    mut panels: Panels<'_, P>,
    put: impl Fn(usize, usize, &[f32]),
) {
    let nb = w.cols / panel::PANEL_COLS;
    let packed_all: Option<&[P]> = match &panels {
        Panels::Packed(all) => Some(*all),
        Panels::PerCall(_) => None,
    };
    let mut outs = [[0.0f32; 8]; TOKENS];
    let mut outs2 = [[0.0f32; 16]; TOKENS];
    let mut quad = [0.0f32; 32];
    let mut dots = [0.0f32; TOKENS];
    let mut tail = [0.0f32; TOKENS * 8];
    let mut b0 = rows.start;
    while b0 < rows.end {
        let b1 = (b0 + block).min(rows.end);
        // Blocks start at whole tiles, so at whole eights.
        debug_assert!(b0.is_multiple_of(8));
        let whole = (b1 - b0) / 8;
        let mine: &[P] = match &mut panels {
            Panels::Packed(all) => &all[b0 / 8 * nb..(b0 / 8 + whole) * nb],
            Panels::PerCall(scratch) => {
                if scratch.len() < whole * nb {
                    scratch.resize(whole * nb, P::default());
                }
                for (p, out) in scratch[..whole * nb]
                    .chunks_exact_mut(nb.max(1))
                    .enumerate()
                {
                    let r0 = b0 + 8 * p;
                    // The next panel's rows load while this one packs (packing stalls
                    // on the file's bytes otherwise: they are read once a product).
                    // (The first block's: the later ones were asked for the block before.)
                    if p + 1 < whole && b0 == rows.start {
                        let next = (r0 + 8) * w.row_bytes..(r0 + 16) * w.row_bytes;
                        prefetch(&w.data.get()[next]);
                    }
                    P::pack(std::array::from_fn(|i| w.row(r0 + i)), out);
                }
                &scratch[..whole * nb]
            }
        };
        // The next block's weights (the file's rows for per-call panels, else the
        // panels) come into the L2 cache a part before each kernel call of this
        // block's passes: asked for by the hardware as the kernel reaches them, they come
        // in a burst that the memory serves slower than the kernel reads, and per-call
        // packing waits on them. Products of 32 tokens with weights past the caches ran
        // 10 % (Q6_K) and 3 % (32 streams of a Q4_K_M model) faster; into the L1
        // cache, where they push out what the kernel reads, 10 % slower.
        let ahead: (&[u8], &[P]) = match packed_all {
            None => {
                let n1 = (b1 + block).min(rows.end);
                (&w.data.get()[b1 * w.row_bytes..n1 * w.row_bytes], &[])
            }
            Some(all) if acts.len() >= PAIR_TOKENS => {
                let n1 = (b1 + block).min(rows.end);
                (&[], all.get(b1 / 8 * nb..n1 / 8 * nb).unwrap_or(&[]))
            }
            Some(_) => (&[], &[]),
        };
        let calls = acts.len().div_ceil(group) * whole.div_ceil(2).max(1);
        let mut call = 0;
        for i0 in (0..acts.len()).step_by(group) {
            let group = &acts[i0..(i0 + group).min(acts.len())];
            let g = group.len();
            // Sixteen rows at a time (two panels), then a last eight. For fewer than 4
            // tokens (decoding, bound by memory) only where `decode_in_pairs` says.
            let pairs = g >= PAIR_TOKENS || decode_in_pairs();
            // Where decoding runs in pairs, four panels a call keep four streams in
            // flight (a token at a time).
            let quads = g < PAIR_TOKENS && decode_in_pairs();
            let mut panels = mine.chunks_exact(nb.max(1)).enumerate();
            while let Some((p, a)) = panels.next() {
                if !ahead.0.is_empty() || !ahead.1.is_empty() {
                    let share = |n: usize| call * n / calls..(call + 1) * n / calls;
                    prefetch_l2(ahead.0.get(share(ahead.0.len())).unwrap_or(&[]));
                    prefetch_l2(ahead.1.get(share(ahead.1.len())).unwrap_or(&[]));
                    call += 1;
                }
                if quads && p + 4 <= whole {
                    let mut more = [a; 3];
                    for m in &mut more {
                        *m = panels.next().map_or(a, |(_, q)| q);
                    }
                    let [b, c, d] = more;
                    for (j, &act) in group.iter().enumerate() {
                        P::gemm_quad_with(panel::Isa::best(), [a, b, c, d], act, &mut quad);
                        put(i0 + j, b0 + 8 * p, &quad);
                    }
                    continue;
                }
                let next = if pairs { panels.next() } else { None };
                if let Some((_, b)) = next {
                    P::gemm_pair(a, b, group, &mut outs2[..g]);
                    for (j, o) in outs2[..g].iter().enumerate() {
                        put(i0 + j, b0 + 8 * p, o);
                    }
                } else {
                    P::gemm(a, group, &mut outs[..g]);
                    for (j, o) in outs[..g].iter().enumerate() {
                        put(i0 + j, b0 + 8 * p, o);
                    }
                }
            }
            let r0 = b0 + 8 * whole;
            if r0 < b1 {
                for r in r0..b1 {
                    (w.dot)(w.row(r), group, &mut dots[..g]);
                    for (j, &d) in dots[..g].iter().enumerate() {
                        tail[j * 8 + r - r0] = d;
                    }
                }
                for j in 0..g {
                    put(i0 + j, r0, &tail[j * 8..j * 8 + b1 - r0]);
                }
            }
        }
        b0 = b1;
    }
}

/// Whether products of fewer than [`PAIR_TOKENS`] token rows (decoding, bound by how
/// fast memory streams the weights in) run two panels a call too, as longer ones do.
/// Two panels are two streams of reads a panel's row of blocks apart, where one panel at
/// a time is one long stream. On an Intel Xeon (Emerald Rapids, 2 cores) the two
/// streams came in faster: one stream of a Q8_0 model generated 1.05-1.26x the tokens a
/// second in pairs (Q4_K_M 1.02-1.18x), and four Q8_0 panels side by side
/// ([`Panel::gemm_quad_with`]) 1.11-1.39x more again. On AMD Zen 4 a 65536-row product
/// of one token ran 2.5x slower in pairs (the prefetcher lost them), so there, and on
/// other CPUs, one panel at a time.
fn decode_in_pairs() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static INTEL: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *INTEL.get_or_init(|| {
            // The vendor string of CPUID leaf 0, in EBX, EDX, ECX.
            let r = std::arch::x86_64::__cpuid(0);
            let mut v = [0u8; 12];
            for (i, w) in [r.ebx, r.edx, r.ecx].into_iter().enumerate() {
                v[4 * i..4 * i + 4].copy_from_slice(&w.to_le_bytes());
            }
            &v == b"GenuineIntel"
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether [`matmul_combined`] serves `a` and `b` for `t` token rows: both packed at
/// load into panels of one type, of one shape, and enough tokens for two panels a call.
pub(crate) fn combines(a: &Matrix, b: &Matrix, t: usize) -> bool {
    let same = matches!(
        (a.packed.as_deref(), b.packed.as_deref()),
        (Some(Packed::Q8_0(_)), Some(Packed::Q8_0(_)))
            | (Some(Packed::Q8_0Sm(_)), Some(Packed::Q8_0Sm(_)))
            | (Some(Packed::Q4K(_)), Some(Packed::Q4K(_)))
    );
    same && a.rows == b.rows && a.cols == b.cols && t >= PAIR_TOKENS
}

/// `y[i][j] = f(a.row(j) · x[i], b.row(j) · x[i])` for two matrices that
/// [`combines`] accepts (a gated MLP's gate and up projections): each kernel call runs
/// eight rows of `a` and the same eight of `b` side by side, and `combine(of_a, of_b,
/// out)` turns a token's up to eight outputs of each into the values stored. The two
/// products' outputs never go to memory, and no pass over them follows. Each
/// product's value is the bits [`matmul`] gives, so `combine` sees what it would
/// have read from two `matmul`s.
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_combined(
    exec: Exec<'_>,
    a: &Matrix,
    b: &Matrix,
    acts: &Acts,
    x: &[f32],
    y: &mut [f32],
    ldy: usize,
    combine: impl Fn(&[f32], &[f32], &mut [f32]) + Sync,
) {
    let (t, k, n) = (acts.t, acts.k, a.rows);
    assert!(
        combines(a, b, t),
        "{} and {}: not combinable",
        a.name,
        b.name
    );
    assert_eq!(
        k, a.cols,
        "{}: activations prepared for another width",
        a.name
    );
    assert!(x.len() >= t * k && ldy >= n && y.len() >= (t - 1) * ldy + n);
    let kind = a.wtype.act();
    match kind {
        ActKind::Q8 => assert!(acts.has_q8, "{}: activations not quantized", a.name),
        ActKind::Q8K => assert!(acts.has_q8k, "{}: activations not quantized", a.name),
        ActKind::F32 => {}
    }
    let tiles = n.div_ceil(TILE);
    // More parts than threads, as in `matmuls`.
    let parts = match exec.parts(2 * t * n * k, tiles) {
        p if p > 1 => (p * PARTS_PER_THREAD).min(tiles),
        p => p,
    };
    let per = tiles.div_ceil(parts);
    let rows: Vec<ActRow<'_>> = (0..t).map(|i| acts.row(kind, x, i)).collect();
    let blocking = Blocking::DEFAULT;
    let group = group_rows(a, acts, blocking);
    // A block of each matrix: together they stay in L2 as the token groups pass.
    let block = (blocking.block_bytes / 2 / a.row_bytes).max(TILE) / TILE * TILE;
    let yp = OutPtr(y.as_mut_ptr());
    let run = |part: usize| {
        let (first, end) = ((part * per * TILE).min(n), ((part + 1) * per * TILE).min(n));
        if first >= end {
            return;
        }
        let put = |i: usize, r: usize, v: &[f32]| {
            // SAFETY: outputs `r..r + v.len()` of token `i` are inside `y` (asserted
            // above: `r + v.len() <= n <= ldy`), and only the part that owns rows
            // `first..end` touches them, so this is the only reference to them while
            // it lives.
            let o = unsafe { std::slice::from_raw_parts_mut(yp.get().add(i * ldy + r), v.len()) };
            if r + 2 * v.len() <= n {
                prefetch_write_line(o.as_ptr().wrapping_add(v.len()));
            }
            store(o, v, Out::Set, r);
        };
        let pair = (a, b, &rows[..], first..end, group, block);
        match (a.packed.as_deref(), b.packed.as_deref()) {
            (Some(Packed::Q8_0(pa)), Some(Packed::Q8_0(pb))) => {
                run_panels_side_by_side(pair, pa, pb, &combine, put)
            }
            (Some(Packed::Q8_0Sm(pa)), Some(Packed::Q8_0Sm(pb))) => {
                run_panels_side_by_side(pair, pa, pb, &combine, put)
            }
            (Some(Packed::Q4K(pa)), Some(Packed::Q4K(pb))) => {
                run_panels_side_by_side(pair, pa, pb, &combine, put)
            }
            // `combines` was asserted.
            _ => {}
        }
    };
    match exec.pool {
        Some(pool) if parts > 1 => pool.run(parts, &run),
        _ => (0..parts).for_each(run),
    }
}

/// Rows `rows` of `a` and of `b` (packed into `pa` and `pb`) against every token row,
/// in blocks of rows and groups of tokens as [`run_panels`] walks them: panel `p` of
/// `a` and panel `p` of `b` in one pair kernel call, their outputs combined there.
/// Rows past the last whole eight use the row kernel (the same bits).
fn run_panels_side_by_side<P: Panel>(
    (a, b, acts, rows, group, block): (
        &Matrix,
        &Matrix,
        &[ActRow<'_>],
        std::ops::Range<usize>,
        usize,
        usize,
    ),
    pa: &[P],
    pb: &[P],
    combine: &impl Fn(&[f32], &[f32], &mut [f32]),
    put: impl Fn(usize, usize, &[f32]),
) {
    let nb = a.cols / panel::PANEL_COLS;
    // Two kernel calls' outputs (panels p and p + 1 of each matrix), so that each token's
    // 16 combined values are stored at once, as `run_panels` stores a pair's; all the
    // group's values of `a` and of `b` side by side, so that one `combine` call takes
    // them all (SiLU's chain of dependent operations on one vector at a time would
    // leave the core waiting; over a few hundred values the iterations overlap).
    let mut outs = [[[0.0f32; 16]; TOKENS]; 2];
    let (mut dots_a, mut dots_b) = ([0.0f32; TOKENS], [0.0f32; TOKENS]);
    let mut va = [0.0f32; TOKENS * 16];
    let mut vb = [0.0f32; TOKENS * 16];
    let mut h = [0.0f32; TOKENS * 16];
    let mut b0 = rows.start;
    while b0 < rows.end {
        let b1 = (b0 + block).min(rows.end);
        // Blocks start at whole tiles, so at whole eights.
        debug_assert!(b0.is_multiple_of(8));
        let whole = (b1 - b0) / 8;
        let (ma, mb) = (
            &pa[b0 / 8 * nb..(b0 / 8 + whole) * nb],
            &pb[b0 / 8 * nb..(b0 / 8 + whole) * nb],
        );
        // The next block of both into L2, a share before each kernel call (see
        // `run_panels`).
        let n1 = (b1 + block).min(rows.end);
        let ahead = [
            pa.get(b1 / 8 * nb..n1 / 8 * nb).unwrap_or(&[]),
            pb.get(b1 / 8 * nb..n1 / 8 * nb).unwrap_or(&[]),
        ];
        let calls = acts.len().div_ceil(group) * whole.max(1);
        let mut call = 0;
        for i0 in (0..acts.len()).step_by(group) {
            let group = &acts[i0..(i0 + group).min(acts.len())];
            let g = group.len();
            let mut p = 0;
            while p < whole {
                let two = (whole - p).min(2);
                for (q, outs) in outs.iter_mut().enumerate().take(two) {
                    let share = |n: usize| call * n / calls..(call + 1) * n / calls;
                    for next in ahead {
                        prefetch_l2(next.get(share(next.len())).unwrap_or(&[]));
                    }
                    call += 1;
                    let at = (p + q) * nb..(p + q + 1) * nb;
                    P::gemm_pair(&ma[at.clone()], &mb[at], group, &mut outs[..g]);
                }
                let w = 8 * two;
                for j in 0..g {
                    for (q, outs) in outs.iter().enumerate().take(two) {
                        let at = j * w + 8 * q..j * w + 8 * q + 8;
                        let (a, b) = outs[j].split_at(8);
                        store(&mut va[at.clone()], a, Out::Set, 0);
                        store(&mut vb[at], b, Out::Set, 0);
                    }
                }
                combine(&va[..g * w], &vb[..g * w], &mut h[..g * w]);
                for (j, h) in h[..g * w].chunks_exact(w).enumerate() {
                    put(i0 + j, b0 + 8 * p, h);
                }
                p += two;
            }
            let r0 = b0 + 8 * whole;
            if r0 < b1 {
                let m = b1 - r0;
                for r in r0..b1 {
                    (a.dot)(a.row(r), group, &mut dots_a[..g]);
                    (b.dot)(b.row(r), group, &mut dots_b[..g]);
                    for j in 0..g {
                        va[j * m + r - r0] = dots_a[j];
                        vb[j * m + r - r0] = dots_b[j];
                    }
                }
                combine(&va[..g * m], &vb[..g * m], &mut h[..g * m]);
                for (j, h) in h[..g * m].chunks_exact(m).enumerate() {
                    put(i0 + j, r0, h);
                }
            }
        }
        b0 = b1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::llm::kernels::tests::bits;
    use crate::llm::quant::tests::random_row;

    /// Q8_0 rows (whole blocks) with each weight of -128 made -127.
    fn without_min(mut data: Vec<u8>) -> Vec<u8> {
        for b in data.chunks_exact_mut(34) {
            b[2..]
                .iter_mut()
                .filter(|q| **q == 0x80)
                .for_each(|q| *q = 0x81);
        }
        assert!(!panel::q8_0_has_min(&data));
        data
    }

    #[test]
    fn outputs_do_not_depend_on_the_batch_or_the_threads() {
        let pool = crate::llm::pool::Pool::new(3, "test").unwrap();
        // 45 rows: two pairs of panels, a last panel alone and 5 rows of the row kernel
        // (for 4 or more tokens; one token runs every panel alone).
        let (n, k, t) = (45, 512, 5);
        // Q8_0 with weights of -128 (random bytes) and without (sign-magnitude panels
        // where the fastest kernels are AVX2's).
        for (wt, pack, no_min) in [
            (WeightType::F16, true, false),
            (WeightType::Q4K, false, false),
            (WeightType::Q4K, true, false),
            (WeightType::Q6K, false, false),
            (WeightType::Q6K, true, false),
            (WeightType::Q8_0, false, false),
            (WeightType::Q8_0, true, false),
            (WeightType::Q8_0, true, true),
        ] {
            let data: Vec<u8> = (0..n)
                .flat_map(|r| random_row(wt, k, r as u64 + 1))
                .collect();
            let data = if no_min { without_min(data) } else { data };
            let mut w = Matrix::new("w", wt, n, k, Bytes::Owned(Arc::new(data))).unwrap();
            if pack {
                w = w.packed().unwrap();
                let packs = matches!(wt, WeightType::Q4K | WeightType::Q8_0);
                assert_eq!(w.is_packed(), packs && panel::available());
                let sm = matches!(w.packed.as_deref(), Some(Packed::Q8_0Sm(_)));
                assert_eq!(
                    sm,
                    w.is_packed() && no_min && panel::Isa::best() == panel::Isa::Avx2,
                    "{} without -128: {no_min}",
                    wt.name()
                );
            }
            let x: Vec<f32> = (0..t * k)
                .map(|i| ((i * 13 % 29) as f32 - 14.0) * 0.1)
                .collect();
            let run = |exec: Exec<'_>, rows: std::ops::Range<usize>| {
                let mut acts = Acts::default();
                let xs = &x[rows.start * k..rows.end * k];
                acts.prepare(exec, xs, rows.len(), k, [wt]).unwrap();
                let mut y = vec![1.0f32; rows.len() * (n + 3)];
                matmul(exec, &w, &acts, xs, &mut y, n + 3, Out::Add);
                y
            };
            let alone = Exec {
                pool: None,
                threads: 1,
                min_par_work: 0,
            };
            let split = Exec {
                pool: Some(&pool),
                threads: 3,
                min_par_work: 0,
            };
            let whole = run(alone, 0..t);
            assert_eq!(bits(&whole), bits(&run(split, 0..t)), "{}", wt.name());
            for i in 0..t {
                let one = run(split, i..i + 1);
                assert_eq!(bits(&whole[i * (n + 3)..(i + 1) * (n + 3)]), bits(&one));
            }
            // Columns past the matrix's rows are untouched.
            assert!(whole.chunks(n + 3).all(|r| r[n..] == [1.0, 1.0, 1.0]));
            // Packed or not, the same bits (the panel kernels' outputs are the row
            // kernels').
            let plain = Matrix::new("w", wt, n, k, w.data.clone()).unwrap();
            let mut acts = Acts::default();
            acts.prepare(alone, &x, t, k, [wt]).unwrap();
            let mut y = vec![1.0f32; t * (n + 3)];
            matmul(alone, &plain, &acts, &x, &mut y, n + 3, Out::Add);
            assert_eq!(bits(&whole), bits(&y), "{} packed", wt.name());
        }
    }

    /// Two packed matrices side by side give each output the bits of two `matmul`s
    /// (combined after), for every count of tokens from 4, split over threads or not,
    /// with rows past the last whole eight (45) and blocks of rows (2,100).
    #[test]
    fn combined_products_are_the_two_products_combined() {
        let pool = crate::llm::pool::Pool::new(3, "test").unwrap();
        let k = 512;
        let combine = |a: &[f32], b: &[f32], o: &mut [f32]| {
            for ((o, &a), &b) in o.iter_mut().zip(a).zip(b) {
                *o = a * 0.5 - b;
            }
        };
        let matrix = |wt: WeightType, n: usize, seed: u64, no_min: bool| {
            let data: Vec<u8> = (0..n)
                .flat_map(|r| random_row(wt, k, seed * 1000 + r as u64))
                .collect();
            let data = if no_min { without_min(data) } else { data };
            Matrix::new("w", wt, n, k, Bytes::Owned(Arc::new(data)))
                .and_then(Matrix::packed)
                .unwrap()
        };
        // Q8_0 with weights of -128 and without (sign-magnitude panels on AVX2).
        for (wt, no_min) in [
            (WeightType::Q8_0, false),
            (WeightType::Q8_0, true),
            (WeightType::Q4K, false),
        ] {
            if !panel::available() {
                break;
            }
            for n in [45, 2100] {
                let (a, b) = (matrix(wt, n, 1, no_min), matrix(wt, n, 2, no_min));
                for t in [4, 7, 33] {
                    let x: Vec<f32> = (0..t * k)
                        .map(|i| ((i * 17 % 31) as f32 - 15.0) * 0.07)
                        .collect();
                    for threads in [1, 3] {
                        let exec = Exec {
                            pool: (threads > 1).then_some(&pool),
                            threads,
                            min_par_work: 0,
                        };
                        let mut acts = Acts::default();
                        acts.prepare(exec, &x, t, k, [wt]).unwrap();
                        assert!(combines(&a, &b, t));
                        let ldy = n + 3;
                        let (mut ya, mut yb) = (vec![0.0f32; t * ldy], vec![0.0f32; t * ldy]);
                        matmul(exec, &a, &acts, &x, &mut ya, ldy, Out::Set);
                        matmul(exec, &b, &acts, &x, &mut yb, ldy, Out::Set);
                        let mut want = vec![1.0f32; t * ldy];
                        for i in 0..t {
                            let r = i * ldy..i * ldy + n;
                            combine(&ya[r.clone()], &yb[r.clone()], &mut want[r]);
                        }
                        let mut got = vec![1.0f32; t * ldy];
                        matmul_combined(exec, &a, &b, &acts, &x, &mut got, ldy, combine);
                        let what = format!("{} n {n} t {t} threads {threads}", wt.name());
                        assert_eq!(bits(&want), bits(&got), "{what}");
                    }
                }
                assert!(!combines(&a, &b, 3), "three tokens run one panel at a time");
            }
        }
        // Not packed alike: the two products run apart.
        let q8 = matrix(WeightType::Q8_0, 16, 1, false);
        let q4 = matrix(WeightType::Q4K, 16, 2, false);
        assert!(!combines(&q8, &q4, 8));
        assert!(!combines(&q8, &matrix(WeightType::Q8_0, 24, 3, false), 8));
        // One Q8_0 matrix with a weight of -128 and one without: packed alike only where
        // the fastest kernels are VNNI's (either form).
        let sm = matrix(WeightType::Q8_0, 16, 4, true);
        assert_eq!(
            combines(&q8, &sm, 8),
            panel::Isa::best() != panel::Isa::Avx2
        );
        let data = random_row(WeightType::Q8_0, k, 9).repeat(16);
        let plain =
            Matrix::new("w", WeightType::Q8_0, 16, k, Bytes::Owned(Arc::new(data))).unwrap();
        assert!(!combines(&plain, &plain, 8));
    }

    /// The resident KiB of this process's mapping that holds `addr` (/proc/self/smaps).
    fn map_rss_kib(addr: usize) -> usize {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut inside = false;
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ') {
                if let Some((a, b)) = range.split_once('-') {
                    if let (Ok(a), Ok(b)) =
                        (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
                    {
                        inside = (a..b).contains(&addr);
                        continue;
                    }
                }
            }
            if let Some(v) = line.strip_prefix("Rss:").filter(|_| inside) {
                return v.trim().trim_end_matches("kB").trim().parse().unwrap();
            }
        }
        panic!("no mapping holds {addr:#x}")
    }

    /// A matrix packed from a mapped file: its pages are released, its rows still read
    /// back as the file's, and its products equal the unpacked matrix's.
    #[test]
    fn packing_a_mapped_matrix_releases_it_and_keeps_its_rows() {
        if !panel::available() {
            return;
        }
        for wt in [WeightType::Q8_0, WeightType::Q4K] {
            packs_a_mapped_matrix(wt);
        }
    }

    fn packs_a_mapped_matrix(wt: WeightType) {
        let (n, k) = (8 * 300 + 3, 1024);
        let data: Vec<u8> = (0..n)
            .flat_map(|r| random_row(wt, k, r as u64 + 7))
            .collect();
        let dir =
            std::env::temp_dir().join(format!("infer-pack-{}-{}", wt.name(), std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("w.bin");
        // An odd offset: the tensor does not start or end at a page.
        let mut file = vec![0x5au8; 1001];
        file.extend_from_slice(&data);
        file.extend_from_slice(&[0xa5; 77]);
        std::fs::write(&path, &file).unwrap();
        // SAFETY: the file is this test's own and nothing writes it while mapped.
        let map =
            Arc::new(unsafe { memmap2::Mmap::map(&std::fs::File::open(&path).unwrap()) }.unwrap());
        let bytes = Bytes::Mapped {
            map: map.clone(),
            start: 1001,
            len: data.len(),
        };
        let plain = Matrix::new("w", wt, n, k, bytes.clone()).unwrap();
        let packed = Matrix::new("w", wt, n, k, bytes).unwrap().packed().unwrap();
        assert!(plain.is_mapped() && !packed.is_mapped() && packed.is_packed());
        // Q8_0's panels are the file's size; Q4_K's take a byte for each 6-bit scale.
        let whole = (n / 8 * 8) * k / 256;
        let want = match wt {
            WeightType::Q4K => data.len() + whole * 4,
            _ => data.len(),
        };
        assert_eq!(packed.bytes(), want, "{} panels", wt.name());
        // This process's resident pages of the map after packing: at most the two
        // partial pages at the tensor's ends.
        let rss = map_rss_kib(map.as_ptr() as usize);
        assert!(
            rss * 1024 <= 2 * page_size(),
            "{}: {rss} KiB of the map still resident",
            wt.name()
        );
        let mut a = vec![0.0f32; k];
        let mut b = vec![0.0f32; k];
        for r in [0, 1, 7, 8, 1234, n - 4, n - 1] {
            plain.row_f32(r, &mut a);
            packed.row_f32(r, &mut b);
            assert_eq!(bits(&a), bits(&b), "{}: row {r}", wt.name());
        }
        assert_eq!(&map[..1001], &[0x5a; 1001][..]);
        assert_eq!(&map[1001 + data.len()..], &[0xa5; 77][..]);
        let exec = Exec {
            pool: None,
            threads: 1,
            min_par_work: 0,
        };
        for t in [1, 9] {
            let x: Vec<f32> = (0..t * k)
                .map(|i| ((i * 5 % 17) as f32 - 8.0) * 0.1)
                .collect();
            let mut acts = Acts::default();
            acts.prepare(exec, &x, t, k, [wt]).unwrap();
            let (mut y1, mut y2) = (vec![0.0f32; t * n], vec![0.0f32; t * n]);
            matmul(exec, &plain, &acts, &x, &mut y1, n, Out::Set);
            matmul(exec, &packed, &acts, &x, &mut y2, n, Out::Set);
            assert_eq!(bits(&y1), bits(&y2), "{}: {t} tokens", wt.name());
        }
        drop((plain, packed, map));
        std::fs::remove_dir_all(&dir).ok();
    }

    /// Multiply-adds per second of `matmul` on prompt- and decode-shaped products, walked
    /// as `Blocking::DEFAULT` says and as the environment says (rounds interleaved, best
    /// of each):
    /// `cargo test --release --lib llm::linear::tests::speed -- --ignored --nocapture`
    /// `INFER_MATMUL_TYPES=q8_0,q4_k` picks the types, `INFER_MATMUL_THREADS` the threads,
    /// `INFER_MATMUL_SHAPES=n,k,t;n,k,t` the shapes (weights past the caches: rows × cols
    /// of tens of MB),
    /// `INFER_MATMUL_GROUP_BYTES` and `INFER_MATMUL_BLOCK_BYTES` the other blocking (by
    /// default, 32 tokens against 16 rows at a time).
    #[test]
    #[ignore]
    fn speed() {
        let env = |name: &str, default: &str| std::env::var(name).unwrap_or(default.into());
        let threads: usize = env("INFER_MATMUL_THREADS", "1").parse().unwrap();
        let pool = crate::llm::pool::Pool::new(threads, "test").unwrap();
        let exec = Exec {
            pool: (threads > 1).then_some(&pool),
            threads,
            min_par_work: 0,
        };
        for name in env("INFER_MATMUL_TYPES", "q8_0,q4_0,q4_k,q6_k").split(',') {
            let wt = WeightType::ALL
                .into_iter()
                .find(|w| w.name().eq_ignore_ascii_case(name))
                .unwrap_or_else(|| panic!("no weight type {name}"));
            let shapes: Vec<(usize, usize, usize)> = match std::env::var("INFER_MATMUL_SHAPES") {
                Ok(v) => v
                    .split(';')
                    .map(|s| {
                        let d: Vec<usize> =
                            s.split(',').map(|d| d.trim().parse().unwrap()).collect();
                        (d[0], d[1], d[2])
                    })
                    .collect(),
                Err(_) => vec![
                    (4096, 1024, 512),
                    (1024, 4096, 512),
                    (4096, 1024, 32),
                    (1024, 1024, 1),
                    (65536, 1024, 1),
                    (32, 1024, 16),
                ],
            };
            for (n, k, t) in shapes {
                let data: Vec<u8> = (0..n)
                    .flat_map(|r| random_row(wt, k, r as u64 + 1))
                    .collect();
                let w = Matrix::new("w", wt, n, k, Bytes::Owned(Arc::new(data)))
                    .and_then(Matrix::packed)
                    .unwrap();
                let other = Blocking {
                    group_bytes: env("INFER_MATMUL_GROUP_BYTES", "1000000").parse().unwrap(),
                    block_bytes: env("INFER_MATMUL_BLOCK_BYTES", "0").parse().unwrap(),
                };
                let x: Vec<f32> = (0..t * k)
                    .map(|i| ((i * 13 % 29) as f32 - 14.0) * 0.1)
                    .collect();
                let mut acts = Acts::default();
                acts.prepare(exec, &x, t, k, [wt]).unwrap();
                let mut y = vec![0.0f32; t * n];
                let mut best = [f64::MAX; 2];
                let reps = (1 << 28) / (n * k * t) + 1;
                for round in 0..10 {
                    let blocking = [other, Blocking::DEFAULT][round % 2];
                    let t0 = std::time::Instant::now();
                    for _ in 0..reps {
                        let target = &mut [Target { y: &mut y, ldy: n }];
                        matmuls(exec, &[(&w, 0, 0, Out::Set)], &acts, &x, target, blocking);
                    }
                    let b = &mut best[round % 2];
                    *b = b.min(t0.elapsed().as_secs_f64() / reps as f64);
                }
                let g = |b: f64| (n * k * t) as f64 / b / 1e9;
                println!(
                    "{:>5} n {n:>5} k {k:>5} t {t:>4}: other {:6.1}, default {:6.1} G multiply-adds/s ({:.2}x)",
                    wt.name(),
                    g(best[0]),
                    g(best[1]),
                    best[0] / best[1],
                );
            }
        }
    }

    #[test]
    fn filling_while_preparing_equals_filling_then_preparing() {
        let pool = crate::llm::pool::Pool::new(3, "test").unwrap();
        let (t, k) = (23, 512);
        let fill = |r: usize, row: &mut [f32]| {
            for (i, v) in row.iter_mut().enumerate() {
                *v = ((r * 31 + i * 7) % 97) as f32 * 0.05 - 2.4;
            }
        };
        let mut want = vec![0.0f32; t * k];
        for (r, row) in want.chunks_exact_mut(k).enumerate() {
            fill(r, row);
        }
        for threads in [1, 3] {
            let exec = Exec {
                pool: (threads > 1).then_some(&pool),
                threads,
                min_par_work: 0,
            };
            let types = [WeightType::Q8_0, WeightType::Q4K];
            let mut a = Acts::default();
            a.prepare(exec, &want, t, k, types).unwrap();
            let mut b = Acts::default();
            let mut got = vec![f32::NAN; t * k];
            b.fill_and_prepare(exec, &mut got, t, k, types, fill)
                .unwrap();
            assert_eq!(bits(&got), bits(&want), "{threads} threads");
            assert!(b.has_q8 && b.has_q8k);
            let q8 = |a: &Acts| -> Vec<(u32, [i8; 32], i32)> {
                a.q8[..t * k / 32]
                    .iter()
                    .map(|q| (q.d.to_bits(), q.qs, q.sum))
                    .collect()
            };
            let q8k = |a: &Acts| -> Vec<(u32, Vec<i8>, [i16; 16])> {
                a.q8k[..t * k / 256]
                    .iter()
                    .map(|q| (q.d.to_bits(), q.qs.to_vec(), q.bsums))
                    .collect()
            };
            assert_eq!(q8(&b), q8(&a), "{threads} threads");
            assert_eq!(q8k(&b), q8k(&a), "{threads} threads");
            // The sums the VNNI Q8_0 kernels take back are the blocks' sums.
            for q in &b.q8[..t * k / 32] {
                assert_eq!(q.sum, q.qs.iter().map(|&v| v as i32).sum::<i32>());
            }
        }
    }

    #[test]
    fn several_products_at_once_equal_each_alone() {
        let pool = crate::llm::pool::Pool::new(3, "test").unwrap();
        let split = Exec {
            pool: Some(&pool),
            threads: 3,
            min_par_work: 0,
        };
        let k = 256;
        let make = |name: &str, wt: WeightType, n: usize, seed: u64| {
            let data: Vec<u8> = (0..n)
                .flat_map(|r| random_row(wt, k, seed + r as u64))
                .collect();
            Matrix::new(name, wt, n, k, Bytes::Owned(Arc::new(data)))
                .and_then(Matrix::packed)
                .unwrap()
        };
        let (a, b, c) = (
            make("a", WeightType::Q8_0, 37, 1),
            make("b", WeightType::Q4K, 20, 100),
            make("c", WeightType::F16, 9, 200),
        );
        let bias: Vec<f32> = (0..20).map(|i| i as f32 * 0.25).collect();
        for t in [1, 6] {
            let x: Vec<f32> = (0..t * k)
                .map(|i| ((i * 7 % 23) as f32 - 11.0) * 0.1)
                .collect();
            let mut acts = Acts::default();
            let types = [a.wtype, b.wtype, c.wtype];
            acts.prepare(split, &x, t, k, types).unwrap();
            // a and b side by side in one target (b with a bias), c in another.
            let (mut ab, mut cy) = (vec![0.5f32; t * 60], vec![0.5f32; t * 9]);
            let products = [
                (&a, 0, 0, Out::Set),
                (&b, 0, 40, Out::Bias(&bias)),
                (&c, 1, 0, Out::Add),
            ];
            let targets = &mut [
                Target {
                    y: &mut ab,
                    ldy: 60,
                },
                Target { y: &mut cy, ldy: 9 },
            ];
            matmuls(split, &products, &acts, &x, targets, Blocking::DEFAULT);
            let (mut ab1, mut cy1) = (vec![0.5f32; t * 60], vec![0.5f32; t * 9]);
            matmul(split, &a, &acts, &x, &mut ab1, 60, Out::Set);
            matmul(split, &b, &acts, &x, &mut ab1[40..], 60, Out::Bias(&bias));
            matmul(split, &c, &acts, &x, &mut cy1, 9, Out::Add);
            assert_eq!(bits(&ab), bits(&ab1));
            assert_eq!(bits(&cy), bits(&cy1));
            // Columns 37..40 of each row are nobody's.
            assert!(ab.chunks(60).all(|r| r[37..40] == [0.5; 3]));
        }
        let x = vec![0.0f32; k];
        let mut acts = Acts::default();
        acts.prepare(split, &x, 1, k, [a.wtype, c.wtype]).unwrap();
        let overlap = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut y = vec![0.0f32; 60];
            let products = [(&a, 0, 0, Out::Set), (&c, 0, 30, Out::Set)];
            let targets = &mut [Target { y: &mut y, ldy: 60 }];
            matmuls(split, &products, &acts, &x, targets, Blocking::DEFAULT);
        }));
        assert!(overlap.is_err(), "overlapping columns were accepted");
    }

    #[test]
    fn sizes_are_checked() {
        let e = Matrix::new(
            "blk.0.attn_q.weight",
            WeightType::Q4K,
            2,
            100,
            Bytes::Owned(Arc::new(vec![0; 10])),
        )
        .err()
        .unwrap();
        assert!(e.message.contains("blk.0.attn_q.weight"), "{e}");
        let e = Matrix::new(
            "w",
            WeightType::Q8_0,
            2,
            64,
            Bytes::Owned(Arc::new(vec![0; 10])),
        )
        .err()
        .unwrap();
        assert!(e.message.contains("needs 136"), "{e}");
    }
}
