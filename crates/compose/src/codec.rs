//! State codecs: how a state's values lie in a file, and the arithmetic that reads them where
//! they lie.
//!
//! * `f32`: exact.
//! * `bf16`: the upper half of each f32 (about 3 significant digits), 2 bytes a value.
//! * `int8`: symmetric integers in groups of [`GROUP`] consecutive values, each group with its
//!   own scale s: a value is s·q with q in −127..=127, s the group's largest magnitude over 127
//!   rounded *up* to bf16, so no value is clipped and each is within s/2 of the original.
//! * `int4`: 4-bit codes in groups of [`GROUP`], a value s·[`INT4_LEVELS`]`[code]` with s the
//!   group's largest magnitude rounded up to bf16: the nearest of 15 levels spaced for
//!   heavy-tailed values. A group is 16 bytes: byte j holds code j in its low nibble and code
//!   j + 16 in its high one (two contiguous halves unpack with a mask and a shift).
//!
//! The last group is padded with zeros.
//!
//! Why groups of 32 along the flat tensor, with one scale each (docs/states.md has the
//! measurements): an SSM state's magnitude varies by orders between heads and between channels
//! of a head, and little along the state dimension (the innermost axis, 16–128 values), so a
//! group within a row of it sees one magnitude; keys and values vary most between tokens and
//! between heads, and a group of 32 channels lies within one token's head. Smaller groups cost
//! more in scales (2 bytes per 32 values: 6% of int4); larger ones span magnitudes.
//!
//! [`Values`] borrows a tensor in any codec; composition ([`crate::weighted_sum_values`],
//! [`crate::compose_per_value_values`], [`crate::mean_values`]) dequantizes inside its sums, a
//! group at a time in registers, and never builds an f32 copy of its inputs.

/// Values per int8 / int4 group (one scale each).
pub const GROUP: usize = 32;

/// Largest int8 magnitude.
const Q8: f32 = 127.0;
/// The 16 values an int4 code stands for, in units of its group's scale (the group's largest
/// magnitude): 15 symmetric levels, denser near zero, and code 15 unused (0). State values are
/// heavy-tailed within a group (median |x| is a tenth of the group's largest), so evenly spaced
/// levels leave most values to the few steps around zero. These levels are a Lloyd-Max fit of
/// |x| / max over groups of states of the bundled Mamba-2 on WikiText-2 train paragraphs:
/// 38% less error than even levels on held-out states of both bundled models (docs/states.md).
pub const INT4_LEVELS: [f32; 16] = [
    -1.0, -0.7187, -0.5035, -0.3443, -0.2227, -0.1308, -0.0601, 0.0, 0.0601, 0.1308, 0.2227, 0.3443, 0.5035, 0.7187,
    1.0, 0.0,
];
/// The int4 code of 0.
const INT4_ZERO: u8 = 7;

/// How a state's `ssm`, `conv`, keys and values are stored (log-decays are always f32).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Codec {
    /// Exact, 4 bytes a value.
    #[default]
    F32,
    /// 2 bytes a value; about 3 significant digits.
    Bf16,
    /// 1 byte a value and a bf16 scale per 32: 1.06 bytes a value (3.8× smaller than f32).
    Int8,
    /// Half a byte a value and a bf16 scale per 32: 0.56 bytes a value (7.1× smaller).
    Int4,
}

impl Codec {
    /// Every codec, in the order of their bytes, largest first.
    pub const ALL: [Codec; 4] = [Codec::F32, Codec::Bf16, Codec::Int8, Codec::Int4];

    /// The name users write (`--state-dtype int4`) and files record.
    pub fn name(self) -> &'static str {
        match self {
            Codec::F32 => "f32",
            Codec::Bf16 => "bf16",
            Codec::Int8 => "int8",
            Codec::Int4 => "int4",
        }
    }

    /// Whether values are stored as integers with a scale per group.
    pub fn is_quantized(self) -> bool {
        matches!(self, Codec::Int8 | Codec::Int4)
    }

    /// Bytes that `len` values take in this codec, scales and padding included.
    pub fn bytes(self, len: usize) -> usize {
        let groups = len.div_ceil(GROUP);
        match self {
            Codec::F32 => 4 * len,
            Codec::Bf16 => 2 * len,
            Codec::Int8 => groups * (GROUP + 2),
            Codec::Int4 => groups * (GROUP / 2 + 2),
        }
    }

    /// The worst absolute error of one value after a round trip, given the largest magnitude
    /// in its group: half a quantization step (the step rounded up to bf16), or bf16's rounding.
    pub fn error_bound(self, group_max: f32) -> f32 {
        let step = |q: f32| round_up_bf16(group_max / q);
        match self {
            Codec::F32 => 0.0,
            Codec::Bf16 => group_max * 2f32.powi(-8),
            Codec::Int8 => step(Q8) / 2.0,
            // Half the widest gap between levels, of the rounded-up scale.
            Codec::Int4 => round_up_bf16(group_max) * (INT4_LEVELS[14] - INT4_LEVELS[13]) / 2.0,
        }
    }
}

impl std::fmt::Display for Codec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Codec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Codec::ALL.into_iter().find(|c| c.name() == s).ok_or_else(|| {
            format!("unknown state codec {s:?}: use f32 (exact), bf16 (half the bytes), int8 (3.8x smaller) or int4 (7.1x smaller)")
        })
    }
}

/// A tensor's values as they lie in a state file (or in memory), borrowed.
#[derive(Debug, Clone, Copy)]
pub enum Values<'a> {
    /// f32 values.
    F32(&'a [f32]),
    /// Little-endian bf16 values, 2 bytes each (no alignment needed).
    Bf16(&'a [u8]),
    /// `len` values in int8 groups: `q` one signed byte per value (whole groups), `scales` one
    /// little-endian bf16 per group.
    Int8 {
        /// The integers, padded to whole groups.
        q: &'a [u8],
        /// A bf16 scale per group.
        scales: &'a [u8],
        /// Values held.
        len: usize,
    },
    /// `len` values in int4 groups: `q` 16 bytes per group (see the module), `scales` as int8's.
    Int4 {
        /// The packed integers, 16 bytes per group.
        q: &'a [u8],
        /// A bf16 scale per group.
        scales: &'a [u8],
        /// Values held.
        len: usize,
    },
}

/// A tensor encoded in a codec: what a state file stores for it.
#[derive(Debug, Clone, PartialEq)]
pub struct Encoded {
    /// The values' bytes (f32 or bf16 little-endian, int8 bytes, or int4 pairs).
    pub values: Vec<u8>,
    /// A little-endian bf16 scale per group (empty for f32 and bf16).
    pub scales: Vec<u8>,
}

/// `x` as the smallest bf16 that is ≥ x (x ≥ 0 and finite).
fn round_up_bf16(x: f32) -> f32 {
    let bits = x.to_bits();
    let down = f32::from_bits(bits & 0xffff_0000);
    if down >= x {
        down
    } else {
        f32::from_bits((bits & 0xffff_0000) + 0x1_0000)
    }
}

/// The code of the level nearest `r` (|r| ≤ 1); ties go to the smaller magnitude.
fn int4_code(r: f32) -> u8 {
    let mut best = INT4_ZERO;
    for c in 0..15u8 {
        let (d, b) = ((INT4_LEVELS[c as usize] - r).abs(), (INT4_LEVELS[best as usize] - r).abs());
        if d < b || (d == b && INT4_LEVELS[c as usize].abs() < INT4_LEVELS[best as usize].abs()) {
            best = c;
        }
    }
    best
}

/// bf16 bits → f32.
#[inline(always)]
fn bf16(lo: u8, hi: u8) -> f32 {
    f32::from_bits(((hi as u32) << 24) | ((lo as u32) << 16))
}

/// The f32's bf16, rounded to nearest even (as `half` and PyTorch round).
fn to_bf16(x: f32) -> [u8; 2] {
    let bits = x.to_bits();
    let rounded = if x.is_nan() { (bits >> 16) | 0x40 } else { (bits + 0x7fff + ((bits >> 16) & 1)) >> 16 };
    (rounded as u16).to_le_bytes()
}

/// Encodes `x` in `codec`. Refuses a non-finite value (its group would have no scale), naming
/// its index.
pub fn encode(x: &[f32], codec: Codec) -> Result<Encoded, usize> {
    let values = match codec {
        Codec::F32 => x.iter().flat_map(|v| v.to_le_bytes()).collect(),
        Codec::Bf16 => x.iter().flat_map(|&v| to_bf16(v)).collect(),
        Codec::Int8 | Codec::Int4 => {
            if let Some(i) = x.iter().position(|v| !v.is_finite()) {
                return Err(i);
            }
            let groups = x.len().div_ceil(GROUP);
            let per = if codec == Codec::Int8 { GROUP } else { GROUP / 2 };
            let mut q = vec![0u8; groups * per];
            let mut scales = Vec::with_capacity(2 * groups);
            for (g, chunk) in x.chunks(GROUP).enumerate() {
                let max = chunk.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let out = &mut q[g * per..(g + 1) * per];
                if codec == Codec::Int8 {
                    let s = round_up_bf16(max / Q8);
                    scales.extend_from_slice(&to_bf16(s));
                    let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
                    for (o, v) in out.iter_mut().zip(chunk) {
                        *o = (v * inv).round().clamp(-Q8, Q8) as i8 as u8;
                    }
                } else {
                    let s = round_up_bf16(max);
                    scales.extend_from_slice(&to_bf16(s));
                    let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
                    let mut codes = [INT4_ZERO; GROUP];
                    for (c, v) in codes.iter_mut().zip(chunk) {
                        *c = int4_code(v * inv);
                    }
                    for (j, o) in out.iter_mut().enumerate() {
                        *o = codes[j] | (codes[j + GROUP / 2] << 4);
                    }
                }
            }
            return Ok(Encoded { values: q, scales });
        }
    };
    Ok(Encoded { values, scales: Vec::new() })
}

impl<'a> Values<'a> {
    /// Values held.
    pub fn len(&self) -> usize {
        match *self {
            Values::F32(v) => v.len(),
            Values::Bf16(b) => b.len() / 2,
            Values::Int8 { len, .. } | Values::Int4 { len, .. } => len,
        }
    }

    /// Whether it holds no value.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The codec its values are in.
    pub fn codec(&self) -> Codec {
        match self {
            Values::F32(_) => Codec::F32,
            Values::Bf16(_) => Codec::Bf16,
            Values::Int8 { .. } => Codec::Int8,
            Values::Int4 { .. } => Codec::Int4,
        }
    }

    /// Bytes read to use every value (scales included).
    pub fn nbytes(&self) -> usize {
        match *self {
            Values::F32(v) => 4 * v.len(),
            Values::Bf16(b) => b.len(),
            Values::Int8 { q, scales, .. } | Values::Int4 { q, scales, .. } => q.len() + scales.len(),
        }
    }

    /// Views `bytes` as `len` values of `codec` (`scales` empty for f32 and bf16, which are read
    /// from `values`); None if the sizes do not fit. f32 bytes must be 4-byte aligned.
    pub fn from_bytes(codec: Codec, values: &'a [u8], scales: &'a [u8], len: usize) -> Option<Self> {
        let groups = len.div_ceil(GROUP);
        match codec {
            Codec::F32 => {
                if values.len() != 4 * len || !(values.as_ptr() as usize).is_multiple_of(4) || !scales.is_empty() {
                    return None;
                }
                // SAFETY: the bytes are 4-byte aligned, as long as 4·len, and borrowed for 'a;
                // every bit pattern is an f32. (Little-endian targets only: the caller checks.)
                Some(Values::F32(unsafe { std::slice::from_raw_parts(values.as_ptr().cast::<f32>(), len) }))
            }
            Codec::Bf16 => (values.len() == 2 * len && scales.is_empty()).then_some(Values::Bf16(values)),
            Codec::Int8 => (values.len() == groups * GROUP && scales.len() == 2 * groups).then_some(Values::Int8 {
                q: values,
                scales,
                len,
            }),
            Codec::Int4 => (values.len() == groups * GROUP / 2 && scales.len() == 2 * groups).then_some(Values::Int4 {
                q: values,
                scales,
                len,
            }),
        }
    }

    /// The scale of group `g` (int8 and int4).
    #[inline(always)]
    fn scale(scales: &[u8], g: usize) -> f32 {
        bf16(scales[2 * g], scales[2 * g + 1])
    }

    /// The first index whose value is not finite (for int8 and int4: the first value of a group
    /// whose scale is not), if any.
    pub fn first_non_finite(&self) -> Option<usize> {
        match *self {
            Values::F32(v) => v.iter().position(|x| !x.is_finite()),
            Values::Bf16(b) => b.chunks_exact(2).position(|p| !bf16(p[0], p[1]).is_finite()),
            Values::Int8 { scales, .. } | Values::Int4 { scales, .. } => {
                (0..scales.len() / 2).find(|&g| !Self::scale(scales, g).is_finite()).map(|g| g * GROUP)
            }
        }
    }

    /// Group `g` dequantized (int8 and int4), padding included.
    #[inline(always)]
    fn group(&self, g: usize) -> [f32; GROUP] {
        let mut out = [0.0f32; GROUP];
        self.accumulate_group(g, 1.0, &mut out);
        out
    }

    /// `acc[j] += w · value[g·GROUP + j]` for the whole group `g` (values past the end are
    /// read as 0): the dequantizing inner loop of every composition, one multiply per group for
    /// the scale. `acc` is a whole group even for the last, short one.
    #[inline(always)]
    pub fn accumulate_group(&self, g: usize, w: f32, acc: &mut [f32; GROUP]) {
        self.accumulate_groups(g, w, std::slice::from_mut(acc));
    }

    /// [`Values::accumulate_group`] for the groups `g0..g0 + acc.len()`, all with weight `w`:
    /// the codec is matched once for the run. On x86-64 with AVX2 and FMA the groups run on
    /// hand-written kernels (the module `x86`; LLVM vectorised the portable loops across groups, with
    /// gathers, 5–10× slower); elsewhere on the portable loops, which give the same sums.
    #[inline(always)]
    pub fn accumulate_groups(&self, g0: usize, w: f32, acc: &mut [[f32; GROUP]]) {
        #[cfg(target_arch = "x86_64")]
        {
            if x86::available() {
                // SAFETY: the CPU has AVX2 and FMA.
                if unsafe { x86::accumulate_groups(self, g0, w, acc) } {
                    return;
                }
            }
        }
        self.accumulate_groups_portable(g0, w, acc);
    }

    /// [`Values::accumulate_groups`] in plain loops.
    fn accumulate_groups_portable(&self, g0: usize, w: f32, acc: &mut [[f32; GROUP]]) {
        let start = g0 * GROUP;
        match *self {
            Values::F32(v) => {
                let whole = ((v.len() - start) / GROUP).min(acc.len());
                let x = &v[start..start + whole * GROUP];
                for (a, x) in acc.iter_mut().zip(x.chunks_exact(GROUP)) {
                    for (a, x) in a.iter_mut().zip(x) {
                        *a = w.mul_add(*x, *a);
                    }
                }
                if let Some(a) = acc.get_mut(whole) {
                    for (j, x) in v[start + whole * GROUP..].iter().take(GROUP).enumerate() {
                        a[j] = w.mul_add(*x, a[j]);
                    }
                }
            }
            Values::Bf16(b) => {
                let len = b.len() / 2;
                for (k, a) in acc.iter_mut().enumerate() {
                    let from = start + k * GROUP;
                    for (j, a) in a.iter_mut().enumerate().take(len.saturating_sub(from).min(GROUP)) {
                        *a = w.mul_add(bf16(b[2 * (from + j)], b[2 * (from + j) + 1]), *a);
                    }
                }
            }
            Values::Int8 { q, scales, .. } => {
                for (k, a) in acc.iter_mut().enumerate() {
                    let g = g0 + k;
                    let c = w * Self::scale(scales, g);
                    for (a, x) in a.iter_mut().zip(&q[g * GROUP..(g + 1) * GROUP]) {
                        *a = c.mul_add(*x as i8 as f32, *a);
                    }
                }
            }
            Values::Int4 { q, scales, .. } => {
                const H: usize = GROUP / 2;
                for (k, a) in acc.iter_mut().enumerate() {
                    let g = g0 + k;
                    let c = w * Self::scale(scales, g);
                    let (lo, hi) = a.split_at_mut(H);
                    for (j, x) in q[g * H..(g + 1) * H].iter().enumerate() {
                        lo[j] = c.mul_add(INT4_LEVELS[(x & 15) as usize], lo[j]);
                        hi[j] = c.mul_add(INT4_LEVELS[(x >> 4) as usize], hi[j]);
                    }
                }
            }
        }
    }

    /// Values `[start, start + out.len())` as f32, written into `out`.
    pub fn dequantize_into(&self, start: usize, out: &mut [f32]) {
        match *self {
            Values::F32(v) => out.copy_from_slice(&v[start..start + out.len()]),
            Values::Bf16(b) => {
                for (o, p) in out.iter_mut().zip(b[2 * start..].chunks_exact(2)) {
                    *o = bf16(p[0], p[1]);
                }
            }
            Values::Int8 { .. } | Values::Int4 { .. } => {
                let mut i = 0;
                while i < out.len() {
                    let (g, j) = ((start + i) / GROUP, (start + i) % GROUP);
                    let whole = (out.len() - i) / GROUP;
                    if j == 0 && whole > 0 {
                        // Whole groups at once: zeros plus one run of the dequantizing sum.
                        let run = &mut out[i..i + whole * GROUP];
                        run.fill(0.0);
                        let (groups, _) = run.as_chunks_mut::<GROUP>();
                        self.accumulate_groups(g, 1.0, groups);
                        i += whole * GROUP;
                        continue;
                    }
                    let group = self.group(g);
                    let m = (GROUP - j).min(out.len() - i);
                    out[i..i + m].copy_from_slice(&group[j..j + m]);
                    i += m;
                }
            }
        }
    }

    /// Every value as f32.
    pub fn to_vec(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.len()];
        self.dequantize_into(0, &mut out);
        out
    }

    /// The 16 values from `e` (a multiple of 16 with `e + 16 ≤ len`) as f32: what the per-value
    /// composition reads a block at a time.
    #[inline(always)]
    pub fn block16(&self, e: usize) -> [f32; 16] {
        match *self {
            Values::F32(v) => v[e..e + 16].try_into().expect("a whole block"),
            Values::Bf16(b) => {
                let x: &[u8; 32] = b[2 * e..2 * e + 32].try_into().expect("a whole block");
                std::array::from_fn(|j| bf16(x[2 * j], x[2 * j + 1]))
            }
            Values::Int8 { q, scales, .. } => {
                let s = Self::scale(scales, e / GROUP);
                let x: &[u8; 16] = q[e..e + 16].try_into().expect("a whole block");
                std::array::from_fn(|j| s * (x[j] as i8 as f32))
            }
            Values::Int4 { q, scales, .. } => {
                let (g, half) = (e / GROUP, e % GROUP);
                let s = Self::scale(scales, g);
                let x: &[u8; 16] = q[g * 16..g * 16 + 16].try_into().expect("a whole group");
                if half == 0 {
                    std::array::from_fn(|j| s * INT4_LEVELS[(x[j] & 15) as usize])
                } else {
                    std::array::from_fn(|j| s * INT4_LEVELS[(x[j] >> 4) as usize])
                }
            }
        }
    }

    /// The address of the byte that holds value `e` (for prefetching).
    #[inline(always)]
    pub fn byte_address(&self, e: usize) -> *const u8 {
        match *self {
            Values::F32(v) => v.as_ptr().wrapping_add(e).cast(),
            Values::Bf16(b) => b.as_ptr().wrapping_add(2 * e),
            Values::Int8 { q, .. } => q.as_ptr().wrapping_add(e),
            Values::Int4 { q, .. } => q.as_ptr().wrapping_add(e / 2),
        }
    }
}

/// The dequantizing inner loops in AVX2 and FMA: a group's 32 values in four registers of
/// eight, converted (sign- or zero-extended bytes, bf16 shifted into f32) and fused into the
/// sums. Each value gets the same operations as in the portable loops, so the sums agree.
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use super::{bf16, Values, GROUP, INT4_LEVELS};
    use std::arch::x86_64::*;

    /// [`INT4_LEVELS`] in two registers: codes 0..8 and 8..16.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn levels() -> [__m256; 2] {
        // SAFETY: 8 floats from each half of a 16-float array.
        unsafe { [_mm256_loadu_ps(INT4_LEVELS.as_ptr()), _mm256_loadu_ps(INT4_LEVELS.as_ptr().add(8))] }
    }

    /// The levels of eight codes (0..16 as 32-bit integers): a permute in each half of the
    /// table, the half chosen by the code's bit 3 (moved to the sign bit for the blend).
    #[target_feature(enable = "avx2")]
    #[inline]
    fn lookup(table: [__m256; 2], codes: __m256i) -> __m256 {
        let low = _mm256_permutevar8x32_ps(table[0], codes);
        let high = _mm256_permutevar8x32_ps(table[1], codes);
        _mm256_blendv_ps(low, high, _mm256_castsi256_ps(_mm256_slli_epi32(codes, 28)))
    }

    /// Whether the kernels can run here (the check is cached by the standard library).
    #[inline(always)]
    pub fn available() -> bool {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }

    /// `out[k][j] = Σᵢ w[i] · part_i[(g0 + k)·GROUP + j]` for parts all in `codec` (bf16, int8
    /// or int4; `parts[i]` its values' and its scales' bytes) and whole groups in bounds: every
    /// part of one group summed in registers, then stored once. Sums in the order of the
    /// parts, each term as [`Values::accumulate_group`] makes it.
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn sum_groups(
        codec: super::Codec,
        parts: &[(&[u8], &[u8])],
        w: &[f32],
        g0: usize,
        out: &mut [[f32; GROUP]],
    ) {
        use super::Codec;
        let bytes_per_group = match codec {
            Codec::F32 => 4 * GROUP,
            Codec::Bf16 => 2 * GROUP,
            Codec::Int8 => GROUP,
            Codec::Int4 => GROUP / 2,
        };
        for (i, (q, s)) in parts.iter().enumerate() {
            let end = (g0 + out.len()) * bytes_per_group;
            assert!(
                q.len() >= end && (codec == Codec::Bf16 || s.len() >= 2 * (g0 + out.len())),
                "part {i} out of bounds"
            );
        }
        let mask = _mm_set1_epi8(15);
        let table = levels();
        for (k, o) in out.iter_mut().enumerate() {
            let g = g0 + k;
            let mut acc = [_mm256_setzero_ps(); 4];
            for ((q, s), &w) in parts.iter().zip(w) {
                // SAFETY: every part holds group g (checked above).
                unsafe {
                    let x = q.as_ptr().add(g * bytes_per_group);
                    match codec {
                        Codec::Int4 => {
                            let c = _mm256_set1_ps(w * bf16(s[2 * g], s[2 * g + 1]));
                            let b = _mm_loadu_si128(x.cast());
                            let lo = _mm_and_si128(b, mask);
                            let hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
                            let halves = [lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)];
                            for (a, h) in acc.iter_mut().zip(halves) {
                                *a = _mm256_fmadd_ps(c, lookup(table, _mm256_cvtepu8_epi32(h)), *a);
                            }
                        }
                        Codec::Int8 => {
                            let c = _mm256_set1_ps(w * bf16(s[2 * g], s[2 * g + 1]));
                            for (j, a) in acc.iter_mut().enumerate() {
                                let i = _mm256_cvtepi8_epi32(_mm_loadl_epi64(x.add(8 * j).cast()));
                                *a = _mm256_fmadd_ps(c, _mm256_cvtepi32_ps(i), *a);
                            }
                        }
                        Codec::Bf16 => {
                            let c = _mm256_set1_ps(w);
                            for (j, a) in acc.iter_mut().enumerate() {
                                let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(x.add(16 * j).cast()));
                                *a = _mm256_fmadd_ps(c, _mm256_castsi256_ps(_mm256_slli_epi32(h, 16)), *a);
                            }
                        }
                        Codec::F32 => {
                            let c = _mm256_set1_ps(w);
                            for (j, a) in acc.iter_mut().enumerate() {
                                *a = _mm256_fmadd_ps(c, _mm256_loadu_ps(x.cast::<f32>().add(8 * j)), *a);
                            }
                        }
                    }
                }
            }
            for (j, a) in acc.into_iter().enumerate() {
                // SAFETY: 8 floats at 8j of a 32-float group.
                unsafe { _mm256_storeu_ps(o.as_mut_ptr().add(8 * j), a) };
            }
        }
    }

    /// Whether the AVX-512 int4 kernel can run here.
    #[inline(always)]
    pub fn avx512_available() -> bool {
        std::arch::is_x86_feature_detected!("avx512f")
    }

    /// [`sum_groups`] for int4 parts on AVX-512: the 16 levels fit one register, so a lookup
    /// is one permute per 16 values (AVX2 takes two permutes and a blend per 8).
    ///
    /// # Safety
    /// The CPU must have AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn sum_groups_int4_avx512(parts: &[(&[u8], &[u8])], w: &[f32], g0: usize, out: &mut [[f32; GROUP]]) {
        const H: usize = GROUP / 2;
        for (i, (q, s)) in parts.iter().enumerate() {
            assert!(q.len() >= (g0 + out.len()) * H && s.len() >= 2 * (g0 + out.len()), "part {i} out of bounds");
        }
        // SAFETY: 16 floats of a 16-float array.
        let table = unsafe { _mm512_loadu_ps(INT4_LEVELS.as_ptr()) };
        let mask = _mm_set1_epi8(15);
        for (k, o) in out.iter_mut().enumerate() {
            let g = g0 + k;
            let (mut lo_acc, mut hi_acc) = (_mm512_setzero_ps(), _mm512_setzero_ps());
            for ((q, s), &w) in parts.iter().zip(w) {
                let c = _mm512_set1_ps(w * bf16(s[2 * g], s[2 * g + 1]));
                // SAFETY: the part holds group g's 16 bytes (checked above).
                let b = unsafe { _mm_loadu_si128(q.as_ptr().add(g * H).cast()) };
                let lo = _mm512_cvtepu8_epi32(_mm_and_si128(b, mask));
                let hi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), mask));
                lo_acc = _mm512_fmadd_ps(c, _mm512_permutexvar_ps(lo, table), lo_acc);
                hi_acc = _mm512_fmadd_ps(c, _mm512_permutexvar_ps(hi, table), hi_acc);
            }
            // SAFETY: 16 floats at 0 and at 16 of a 32-float group.
            unsafe {
                _mm512_storeu_ps(o.as_mut_ptr(), lo_acc);
                _mm512_storeu_ps(o.as_mut_ptr().add(H), hi_acc);
            }
        }
    }

    /// [`Values::accumulate_groups`] for whole groups; false (nothing done) when the run holds
    /// a short last group, which the portable loop takes.
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn accumulate_groups(v: &Values<'_>, g0: usize, w: f32, acc: &mut [[f32; GROUP]]) -> bool {
        let (start, n) = (g0 * GROUP, acc.len());
        if start + n * GROUP > v.len() {
            return false;
        }
        let wv = _mm256_set1_ps(w);
        match *v {
            Values::F32(x) => {
                let x = &x[start..start + n * GROUP];
                for (a, x) in acc.iter_mut().zip(x.chunks_exact(GROUP)) {
                    for k in 0..4 {
                        // SAFETY: 8 floats at 8k of a 32-float group, in bounds of both.
                        unsafe {
                            let p = a.as_mut_ptr().add(8 * k);
                            let xs = _mm256_loadu_ps(x.as_ptr().add(8 * k));
                            _mm256_storeu_ps(p, _mm256_fmadd_ps(wv, xs, _mm256_loadu_ps(p)));
                        }
                    }
                }
            }
            Values::Bf16(b) => {
                let b = &b[2 * start..2 * (start + n * GROUP)];
                for (a, x) in acc.iter_mut().zip(b.chunks_exact(2 * GROUP)) {
                    for k in 0..4 {
                        // SAFETY: 8 bf16 (16 bytes) at 16k of a 64-byte group, in bounds.
                        unsafe {
                            let p = a.as_mut_ptr().add(8 * k);
                            let h = _mm_loadu_si128(x.as_ptr().add(16 * k).cast());
                            let xs = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
                            _mm256_storeu_ps(p, _mm256_fmadd_ps(wv, xs, _mm256_loadu_ps(p)));
                        }
                    }
                }
            }
            Values::Int8 { q, scales, .. } => {
                let q = &q[start..start + n * GROUP];
                let scales = &scales[2 * g0..2 * (g0 + n)];
                for ((a, x), s) in acc.iter_mut().zip(q.chunks_exact(GROUP)).zip(scales.chunks_exact(2)) {
                    let c = _mm256_set1_ps(w * bf16(s[0], s[1]));
                    for k in 0..4 {
                        // SAFETY: 8 bytes at 8k of a 32-byte group, in bounds.
                        unsafe {
                            let p = a.as_mut_ptr().add(8 * k);
                            let i = _mm256_cvtepi8_epi32(_mm_loadl_epi64(x.as_ptr().add(8 * k).cast()));
                            _mm256_storeu_ps(p, _mm256_fmadd_ps(c, _mm256_cvtepi32_ps(i), _mm256_loadu_ps(p)));
                        }
                    }
                }
            }
            Values::Int4 { q, scales, .. } => {
                const H: usize = GROUP / 2;
                let q = &q[g0 * H..(g0 + n) * H];
                let scales = &scales[2 * g0..2 * (g0 + n)];
                let mask = _mm_set1_epi8(15);
                let table = levels();
                for ((a, x), s) in acc.iter_mut().zip(q.chunks_exact(H)).zip(scales.chunks_exact(2)) {
                    let c = _mm256_set1_ps(w * bf16(s[0], s[1]));
                    // SAFETY: the group's 16 bytes and its 32 sums, in bounds.
                    unsafe {
                        let bytes = _mm_loadu_si128(x.as_ptr().cast());
                        let lo = _mm_and_si128(bytes, mask);
                        let hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
                        // Values 0..16 are the low nibbles, 16..32 the high ones, 8 a register.
                        let halves = [lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)];
                        for (k, h) in halves.into_iter().enumerate() {
                            let p = a.as_mut_ptr().add(8 * k);
                            let v = lookup(table, _mm256_cvtepu8_epi32(h));
                            _mm256_storeu_ps(p, _mm256_fmadd_ps(c, v, _mm256_loadu_ps(p)));
                        }
                    }
                }
            }
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|i| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let u = (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                // Magnitudes that vary by orders between groups, as a state's do.
                u * 10f32.powi((i / GROUP % 7) as i32 - 3)
            })
            .collect()
    }

    #[test]
    fn round_trips_are_within_half_a_step_of_each_group() {
        for len in [1, 31, 32, 33, 100, 1024] {
            let x = sample(len, len as u64);
            for codec in Codec::ALL {
                let e = encode(&x, codec).unwrap();
                let a = aligned(&e.values);
                let v = Values::from_bytes(codec, a.as_bytes(), &e.scales, len).unwrap();
                assert_eq!(v.nbytes(), codec.bytes(len), "{codec} at {len}");
                let back = v.to_vec();
                for (g, (chunk, got)) in x.chunks(GROUP).zip(back.chunks(GROUP)).enumerate() {
                    let max = chunk.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                    let bound = codec.error_bound(max);
                    for (a, b) in chunk.iter().zip(got) {
                        assert!((a - b).abs() <= bound, "{codec} group {g}: {a} came back {b}, bound {bound}");
                    }
                }
            }
        }
    }

    /// f32 bytes copied to a 4-byte aligned buffer.
    struct Aligned(Vec<f32>, usize);
    impl Aligned {
        fn as_bytes(&self) -> &[u8] {
            // SAFETY: a Vec<f32>'s bytes, borrowed with it.
            unsafe { std::slice::from_raw_parts(self.0.as_ptr().cast::<u8>(), self.1) }
        }
    }
    fn aligned(b: &[u8]) -> Aligned {
        let mut v = vec![0.0f32; b.len().div_ceil(4)];
        // SAFETY: writing b.len() bytes into a buffer at least that long.
        unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), v.as_mut_ptr().cast::<u8>(), b.len()) };
        Aligned(v, b.len())
    }

    #[test]
    fn quantized_codecs_keep_zeros_signs_and_the_group_maximum_exactly() {
        let mut x = vec![0.0f32; 64];
        x[3] = -2.5;
        x[40] = 1e-30;
        for codec in [Codec::Int8, Codec::Int4] {
            let e = encode(&x, codec).unwrap();
            let back = Values::from_bytes(codec, &e.values, &e.scales, 64).unwrap().to_vec();
            assert_eq!(back.iter().filter(|v| **v == 0.0).count(), 62, "{codec}");
            assert!(back[3] < 0.0 && (back[3] + 2.5).abs() <= codec.error_bound(2.5));
            assert!(back[40] > 0.0);
        }
    }

    #[test]
    fn non_finite_values_are_refused_by_index() {
        assert_eq!(encode(&[1.0, f32::NAN], Codec::Int4), Err(1));
        assert_eq!(encode(&[f32::INFINITY], Codec::Int8), Err(0));
    }

    #[test]
    fn sizes_that_do_not_fit_are_refused() {
        let e = encode(&sample(40, 1), Codec::Int4).unwrap();
        assert!(Values::from_bytes(Codec::Int4, &e.values, &e.scales, 40).is_some());
        assert!(Values::from_bytes(Codec::Int4, &e.values, &e.scales, 65).is_none());
        assert!(Values::from_bytes(Codec::Int4, &e.values[1..], &e.scales, 40).is_none());
        assert!(Values::from_bytes(Codec::Int8, &e.values, &e.scales, 40).is_none());
    }

    #[test]
    fn block16_and_ranges_agree_with_the_whole_tensor() {
        let x = sample(96, 7);
        for codec in Codec::ALL {
            let e = encode(&x, codec).unwrap();
            let a = aligned(&e.values);
            let v = Values::from_bytes(codec, a.as_bytes(), &e.scales, 96).unwrap();
            let all = v.to_vec();
            for b in 0..6 {
                assert_eq!(v.block16(16 * b), all[16 * b..16 * b + 16], "{codec} block {b}");
            }
            let mut part = vec![0.0; 50];
            v.dequantize_into(7, &mut part);
            assert_eq!(part, all[7..57]);
        }
    }

    #[test]
    fn names_parse_and_an_unknown_one_says_what_exists() {
        for c in Codec::ALL {
            assert_eq!(c.name().parse::<Codec>(), Ok(c));
        }
        let e = "int2".parse::<Codec>().unwrap_err();
        assert!(e.contains("int2") && e.contains("int4"), "{e}");
    }
}
