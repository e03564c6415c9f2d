//! The operation codes the kernels of kernels.cu switch on, by name. kernels.cu declares
//! the same codes as C enums (`INFER_UNARY_RELU`, ...); the test below reads them there,
//! so the two lists cannot drift apart.

/// One family's codes, as a module of constants and the list `ALL` of (name, code).
macro_rules! codes {
    ($(#[$doc:meta])* $family:ident, $prefix:literal { $($name:ident = $code:literal,)* }) => {
        $(#[$doc])*
        pub mod $family {
            $(pub const $name: i64 = $code;)*
            /// Every code of the family, with its name, for the agreement test.
            #[allow(dead_code)]
            pub const ALL: &[(&str, i64)] = &[$((stringify!($name), $code)),*];
            /// The C enum's prefix in kernels.cu.
            #[allow(dead_code)]
            pub const PREFIX: &str = $prefix;
        }
    };
}

codes! {
    /// `k_unary`'s operations: `infer_unary`'s `p[0]`, the fused kernel's unary instructions.
    unary, "INFER_UNARY_" {
        IDENTITY = 0,
        RELU = 1,
        SIGMOID = 2,
        TANH = 3,
        ERF = 4,
        GELU = 5,
        GELU_TANH = 6,
        EXP = 7,
        LOG = 8,
        SQRT = 9,
        NEG = 10,
        ABS = 11,
        RECIPROCAL = 12,
        LEAKY_RELU = 13,
        CLIP = 14,
        FLOOR = 15,
        CEIL = 16,
        SIN = 17,
        COS = 18,
        SOFTPLUS = 19,
        HARD_SIGMOID = 20,
        ELU = 21,
        ROUND = 22,
        SIGN = 23,
        TAN = 24,
        ASIN = 25,
        ACOS = 26,
        ATAN = 27,
        SINH = 28,
        COSH = 29,
        ASINH = 30,
        ACOSH = 31,
        ATANH = 32,
        SOFTSIGN = 33,
        SELU = 34,
        THRESHOLDED_RELU = 35,
        SHRINK = 36,
        MISH = 37,
        HARD_SWISH = 38,
        CELU = 39,
        SWISH = 40,
    }
}

codes! {
    /// `k_binary`'s operations: `infer_binary`'s `p[0]`, the fused kernel's binary instructions.
    binary, "INFER_BINARY_" {
        ADD = 0,
        SUB = 1,
        MUL = 2,
        DIV = 3,
        POW = 4,
        MAX = 5,
        MIN = 6,
        PRELU = 7,
        FMOD = 8,
        MOD = 9,
    }
}

codes! {
    /// `infer_int`'s operations (`p[0]`): two operands up to `SHR`, one from `NEG` on.
    int, "INFER_INT_" {
        ADD = 0,
        SUB = 1,
        MUL = 2,
        DIV = 3,
        POW = 4,
        MAX = 5,
        MIN = 6,
        MOD = 7,
        FMOD = 8,
        AND = 9,
        OR = 10,
        XOR = 11,
        SHL = 12,
        SHR = 13,
        NEG = 14,
        ABS = 15,
        SIGN = 16,
        NOT = 17,
        CLIP = 18,
    }
}

codes! {
    /// `infer_compare`'s operations (`p[0]`): two operands up to `XOR`, one from `NOT` on.
    compare, "INFER_CMP_" {
        EQUAL = 0,
        LESS = 1,
        GREATER = 2,
        LESS_OR_EQUAL = 3,
        GREATER_OR_EQUAL = 4,
        AND = 5,
        OR = 6,
        XOR = 7,
        NOT = 8,
        IS_NAN = 9,
        IS_INF = 10,
    }
}

codes! {
    /// `infer_reduce`'s reductions (`p[2]`).
    reduce, "INFER_REDUCE_" {
        SUM = 0,
        MEAN = 1,
        MAX = 2,
        MIN = 3,
        PROD = 4,
        SUM_SQUARE = 5,
        L2 = 6,
        L1 = 7,
    }
}

codes! {
    /// The kinds of `infer_fused`'s instructions.
    fused, "INFER_FUSED_" {
        UNARY = 0,
        BINARY = 1,
        BINARY_IMM_B = 2,
        BINARY_IMM_A = 3,
    }
}

#[cfg(test)]
mod tests {
    /// Every family: each Rust name has the same code in kernels.cu's enum, and the enum
    /// has no code the Rust side lacks.
    #[test]
    fn the_codes_agree_with_kernels_cu() {
        let src = include_str!("kernels.cu");
        let families: [(&str, &[(&str, i64)]); 6] = [
            (super::unary::PREFIX, super::unary::ALL),
            (super::binary::PREFIX, super::binary::ALL),
            (super::int::PREFIX, super::int::ALL),
            (super::compare::PREFIX, super::compare::ALL),
            (super::reduce::PREFIX, super::reduce::ALL),
            (super::fused::PREFIX, super::fused::ALL),
        ];
        for (prefix, all) in families {
            let declared: Vec<(String, i64)> = src
                .lines()
                .map(str::trim)
                .filter(|l| l.starts_with(prefix) && l.ends_with(','))
                .filter_map(|l| {
                    let (name, code) = l.trim_end_matches(',').split_once(" = ")?;
                    Some((name[prefix.len()..].to_owned(), code.parse().ok()?))
                })
                .collect();
            let ours: Vec<(String, i64)> = all.iter().map(|(n, c)| ((*n).to_owned(), *c)).collect();
            assert_eq!(declared, ours, "{prefix}* in kernels.cu");
        }
    }
}
