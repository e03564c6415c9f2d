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
}

impl Kernel {
    pub const ALL: [Kernel; 13] = [
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
    ];

    pub fn name(self) -> &'static std::ffi::CStr {
        match self {
            Kernel::Unary => c"infer_unary_f32",
            Kernel::Binary => c"infer_binary_f32",
            Kernel::StridedCopy => c"infer_strided_copy",
            Kernel::Cast => c"infer_cast",
            Kernel::Softmax => c"infer_softmax_f32",
            Kernel::LayerNorm => c"infer_layernorm_f32",
            Kernel::ArgMax => c"infer_argmax_f32",
            Kernel::Reduce => c"infer_reduce_f32",
            Kernel::Gather => c"infer_gather",
            Kernel::Conv2d => c"infer_conv2d_f32",
            Kernel::Im2col => c"infer_im2col_f32",
            Kernel::Pool2d => c"infer_pool2d_f32",
            Kernel::Where => c"infer_where",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kargs_has_the_c_layout() {
        // 4 pointers, out, n, rank, dims[8], strides[4][8], off[4], ostrides[8], ooff,
        // p[16] (8 bytes each) and f[4] (4 bytes each).
        let words = 4 + 1 + 1 + 1 + 8 + 32 + 4 + 8 + 1 + 16;
        assert_eq!(std::mem::size_of::<KArgs>(), words * 8 + 16);
        assert_eq!(std::mem::offset_of!(KArgs, p), (words - 16) * 8);
    }

    #[test]
    fn every_kernel_is_defined_in_the_source() {
        let src = include_str!("../kernels/kernels.cu");
        for k in Kernel::ALL {
            let name = k.name().to_str().unwrap_or("");
            assert!(src.contains(name), "kernels.cu has no {name}");
        }
        assert!(src.contains("typedef struct infer_kargs"));
    }
}
