//! The kernels' argument block (`infer_kargs` in kernels.cu) and the kernels by name.

/// Mirror of `struct infer_kargs` (kernels.cu): passed by value to every kernel.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct KArgs {
    pub inp: [u64; 4],
    pub out: u64,
    pub n: i64,
    pub rank: i64,
    pub dims: [i64; 8],
    pub strides: [[i64; 8]; 4],
    pub off: [i64; 4],
    pub ostrides: [i64; 8],
    pub ooff: i64,
    pub p: [i64; 16],
    pub f: [f32; 4],
    /// Element type of the float kernels' float operands: 0 f32, 1 f16, 2 bf16
    /// (`Dt::float_code`).
    pub ft: i64,
}

/// The kernels of kernels.cu.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kernel {
    Unary,
    Binary,
    StridedCopy,
    Cast,
    Softmax,
    LayerNorm,
    ArgMax,
    Reduce,
    Gather,
    Conv2d,
    Im2col,
    Pool2d,
    Where,
    Fused,
    Compare,
    Pad,
    Col2im,
    Resize,
    Int,
    CumSum,
    GatherElements,
    ScatterElements,
    TopK,
    Nd,
    Rope,
}

impl Kernel {
    pub const ALL: [Kernel; 25] = [
        Kernel::Unary,
        Kernel::Binary,
        Kernel::StridedCopy,
        Kernel::Cast,
        Kernel::Softmax,
        Kernel::LayerNorm,
        Kernel::ArgMax,
        Kernel::Reduce,
        Kernel::Gather,
        Kernel::Conv2d,
        Kernel::Im2col,
        Kernel::Pool2d,
        Kernel::Where,
        Kernel::Fused,
        Kernel::Compare,
        Kernel::Pad,
        Kernel::Col2im,
        Kernel::Resize,
        Kernel::Int,
        Kernel::CumSum,
        Kernel::GatherElements,
        Kernel::ScatterElements,
        Kernel::TopK,
        Kernel::Nd,
        Kernel::Rope,
    ];

    /// The kernel's place in [`Kernel::ALL`] (the order the module loads them in).
    pub fn index(self) -> usize {
        self as usize
    }

    pub fn name(self) -> &'static std::ffi::CStr {
        match self {
            Kernel::Unary => c"infer_unary",
            Kernel::Binary => c"infer_binary",
            Kernel::StridedCopy => c"infer_strided_copy",
            Kernel::Cast => c"infer_cast",
            Kernel::Softmax => c"infer_softmax",
            Kernel::LayerNorm => c"infer_layernorm",
            Kernel::ArgMax => c"infer_argmax",
            Kernel::Reduce => c"infer_reduce",
            Kernel::Gather => c"infer_gather",
            Kernel::Conv2d => c"infer_conv2d",
            Kernel::Im2col => c"infer_im2col",
            Kernel::Pool2d => c"infer_pool2d",
            Kernel::Where => c"infer_where",
            Kernel::Fused => c"infer_fused",
            Kernel::Compare => c"infer_compare",
            Kernel::Int => c"infer_int",
            Kernel::CumSum => c"infer_cumsum",
            Kernel::GatherElements => c"infer_gather_elements",
            Kernel::ScatterElements => c"infer_scatter_elements",
            Kernel::TopK => c"infer_topk",
            Kernel::Nd => c"infer_nd",
            Kernel::Rope => c"infer_rope",
            Kernel::Pad => c"infer_pad",
            Kernel::Col2im => c"infer_col2im",
            Kernel::Resize => c"infer_resize",
        }
    }

    /// Threads per block of every launch, and the most blocks (kernels loop over the rest).
    const THREADS: u32 = 256;
    const MAX_BLOCKS: u32 = 1024;

    /// The launch geometry for `a`: (blocks, threads per block).
    ///
    /// Most kernels are grid-stride loops with a thread per work item: a block per
    /// `THREADS` items. The cooperative ones (Softmax, LayerNorm, ArgMax, Reduce, CumSum,
    /// TopK: the threads of a block share each row's or line's work through shared
    /// memory) take their outputs in tiles of `team_lanes` outputs, a block per tile (a
    /// block per row once rows have `THREADS` elements or more). Any geometry is correct (the
    /// kernels loop over what the grid does not cover); this one only sizes the grid.
    pub fn geometry(self, a: &KArgs) -> (u32, u32) {
        let threads = i64::from(Self::THREADS);
        let per_block = match self {
            Kernel::Softmax | Kernel::LayerNorm => team_lanes(a.p[0], 1, threads),
            Kernel::ArgMax | Kernel::Reduce | Kernel::CumSum | Kernel::TopK => {
                team_lanes(a.p[0], a.p[1], threads)
            }
            _ => threads,
        };
        let blocks = (a.n.max(1) + per_block - 1) / per_block;
        (
            blocks.clamp(1, i64::from(Self::MAX_BLOCKS)) as u32,
            Self::THREADS,
        )
    }
}

/// How many outputs a block of `threads` threads of a cooperative kernel works on at a
/// time, for outputs that each reduce `len` elements `inner` apart: `k_team_make` in
/// kernels.cu (as many threads per output as it has elements, up to the block; strided
/// outputs first get enough lanes for their contiguous run).
fn team_lanes(len: i64, inner: i64, threads: i64) -> i64 {
    let lanes = if inner < threads {
        inner.max(1)
    } else {
        threads
    };
    let groups = len.clamp(1, threads / lanes);
    threads / groups
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_takes_a_block_per_tile() {
        let args = |n: i64, p0: i64, p1: i64| {
            let mut a = KArgs {
                n,
                ..Default::default()
            };
            a.p[0] = p0;
            a.p[1] = p1;
            a
        };
        // a thread per item
        assert_eq!(Kernel::Unary.geometry(&args(1000, 0, 0)), (4, 256));
        assert_eq!(Kernel::Unary.geometry(&args(1 << 30, 0, 0)), (1024, 256));
        // rows of 768 (and 300): a block per row; of 7: 36 rows per block
        assert_eq!(Kernel::Softmax.geometry(&args(100, 768, 0)), (100, 256));
        assert_eq!(Kernel::LayerNorm.geometry(&args(8192, 300, 0)), (1024, 256));
        assert_eq!(Kernel::Softmax.geometry(&args(100, 7, 0)), (3, 256));
        // reductions: contiguous (inner 1) as rows; strided: the contiguous run of outputs
        // first (inner 1000: 256 outputs per block; inner 4: 4 outputs of 64 threads)
        assert_eq!(Kernel::Reduce.geometry(&args(10, 5000, 1)), (10, 256));
        assert_eq!(Kernel::ArgMax.geometry(&args(3000, 50, 1000)), (12, 256));
        assert_eq!(Kernel::Reduce.geometry(&args(40, 5000, 4)), (10, 256));
        assert_eq!(Kernel::Reduce.geometry(&args(40, 2, 4)), (1, 256));
        // scans and TopK: a line's elements as a reduction's (a line of 32000: a block)
        assert_eq!(Kernel::TopK.geometry(&args(3, 32000, 1)), (3, 256));
        assert_eq!(Kernel::CumSum.geometry(&args(12, 100, 3)), (4, 256));
    }

    #[test]
    fn a_kernels_index_is_its_place_in_all() {
        for (i, k) in Kernel::ALL.iter().enumerate() {
            assert_eq!(k.index(), i, "{k:?}");
        }
    }

    #[test]
    fn kargs_has_the_c_layout() {
        // 4 pointers, out, n, rank, dims[8], strides[4][8], off[4], ostrides[8], ooff,
        // p[16] (8 bytes each), f[4] (4 bytes each) and ft.
        let words = 4 + 1 + 1 + 1 + 8 + 32 + 4 + 8 + 1 + 16;
        assert_eq!(std::mem::size_of::<KArgs>(), words * 8 + 16 + 8);
        assert_eq!(std::mem::offset_of!(KArgs, p), (words - 16) * 8);
        assert_eq!(std::mem::offset_of!(KArgs, ft), words * 8 + 16);
    }

    #[test]
    fn every_kernel_is_defined_in_the_source() {
        let src = include_str!("kernels.cu");
        for k in Kernel::ALL {
            let name = k.name().to_str().unwrap_or("");
            assert!(
                src.contains(&format!("X({name})")),
                "kernels.cu has no {name}"
            );
        }
        assert!(src.contains("typedef struct infer_kargs"));
    }
}
