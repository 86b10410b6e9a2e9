//! Nearest-neighbour search over embeddings: the [`VectorIndex`] trait and [`FlatIndex`], an
//! exact, multi-threaded scan.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use rayon::prelude::*;

use crate::error::{Error, Result};

/// A store of fixed-dimension vectors searchable by inner product (= cosine for the
/// L2-normalised vectors [`Embedder`](crate::Embedder) makes).
///
/// Vectors are identified by the order they were added in (0, 1, 2, …). [`FlatIndex`] is exact;
/// an approximate index or a client of an external engine can implement the same trait and
/// replace it without changing callers.
pub trait VectorIndex: Send + Sync {
    /// Dimension of every vector.
    fn dim(&self) -> usize;

    /// Number of vectors stored.
    fn len(&self) -> usize;

    /// Whether no vector is stored.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Stores `vector` and returns its id. Fails if its length is not [`dim`](Self::dim) or a
    /// value is not finite.
    fn add(&mut self, vector: &[f32]) -> Result<usize>;

    /// The (at most) `k` stored vectors with the highest inner product with `query`, as
    /// `(id, score)`, best first; equal scores are ordered by lower id. Fails if the query's
    /// length is not [`dim`](Self::dim) or a value is not finite.
    fn search(&self, query: &[f32], k: usize) -> Result<Vec<(usize, f32)>>;

    /// [`search`](Self::search) for each query of `queries`, a row-major (n, dim) matrix.
    fn search_batch(&self, queries: &[f32], k: usize) -> Result<Vec<Vec<(usize, f32)>>> {
        check_matrix(queries, self.dim(), "queries")?;
        queries.chunks_exact(self.dim().max(1)).map(|q| self.search(q, k)).collect()
    }
}

/// Exact search by a full scan: vectors in one contiguous row-major `Vec<f32>`, scored in
/// parallel blocks with a vectorised dot product, the best `k` of each block kept in a bounded
/// heap (no full sort), then merged.
#[derive(Debug, Clone, PartialEq)]
pub struct FlatIndex {
    dim: usize,
    data: Vec<f32>,
}

/// Rows scored per parallel task: 1024 rows of 384 f32 are 1.5 MiB, within a core's L2.
const BLOCK_ROWS: usize = 1024;
/// Below this many rows a query is scanned on the calling thread.
const PARALLEL_MIN_ROWS: usize = 4 * BLOCK_ROWS;

impl FlatIndex {
    /// An empty index of `dim`-dimensional vectors. Fails if `dim` is 0.
    pub fn new(dim: usize) -> Result<Self> {
        Self::with_capacity(dim, 0)
    }

    /// An empty index with room for `capacity` vectors.
    pub fn with_capacity(dim: usize, capacity: usize) -> Result<Self> {
        if dim == 0 {
            return Err(Error::Input("index dimension must be positive".into()));
        }
        let mut index = Self { dim, data: Vec::new() };
        index.reserve_values(dim.saturating_mul(capacity));
        Ok(index)
    }

    /// An index holding the rows of `data`, a row-major (n, dim) matrix. Fails if `dim` is 0,
    /// `data` is not a whole number of rows, or a value is not finite.
    pub fn from_flat(dim: usize, data: Vec<f32>) -> Result<Self> {
        if dim == 0 {
            return Err(Error::Input("index dimension must be positive".into()));
        }
        check_matrix(&data, dim, "vectors")?;
        if data.len() * std::mem::size_of::<f32>() < HUGE_PAGE_MIN_BYTES {
            return Ok(Self { dim, data });
        }
        // Large matrices are copied once into a buffer on huge pages.
        let mut index = Self { dim, data: Vec::new() };
        index.reserve_values(data.len());
        index.data.extend_from_slice(&data);
        Ok(index)
    }

    /// Makes room for `n` more values. Large buffers are allocated here (never by `Vec`'s own
    /// growth) so that they can be put on 2 MiB pages before they are written: a scan then
    /// takes one TLB miss per 2 MiB instead of per 4 KiB.
    fn reserve_values(&mut self, n: usize) {
        let needed = self.data.len().saturating_add(n);
        if needed <= self.data.capacity() {
            return;
        }
        let capacity = needed.max(self.data.capacity().saturating_mul(2));
        let mut grown: Vec<f32> = Vec::with_capacity(capacity);
        advise_huge_pages(grown.as_mut_ptr().cast(), capacity * std::mem::size_of::<f32>());
        grown.extend_from_slice(&self.data);
        self.data = grown;
    }

    /// Appends every row of `vectors`, a row-major (n, dim) matrix; returns the id of the
    /// first. Nothing is added if any row is invalid.
    pub fn extend_from_flat(&mut self, vectors: &[f32]) -> Result<usize> {
        check_matrix(vectors, self.dim, "vectors")?;
        let first = self.len();
        self.reserve_values(vectors.len());
        self.data.extend_from_slice(vectors);
        Ok(first)
    }

    /// The stored vector `id`, if there is one.
    pub fn vector(&self, id: usize) -> Option<&[f32]> {
        self.data.get(id * self.dim..(id + 1) * self.dim)
    }

    /// [`VectorIndex::search`] among the vectors `ids` only (a subset the caller chose, such as
    /// one document's): the same scores and order as a search of an index holding just them.
    /// Fails on an id the index does not hold.
    pub fn search_among(&self, query: &[f32], k: usize, ids: &[usize]) -> Result<Vec<(usize, f32)>> {
        self.check_query(query)?;
        if let Some(&id) = ids.iter().find(|&&id| id >= self.len()) {
            return Err(Error::Input(format!("vector {id} is not in the index, which holds {}", self.len())));
        }
        let k = k.min(ids.len());
        if k == 0 {
            return Ok(Vec::new());
        }
        let top = if ids.len() < PARALLEL_MIN_ROWS {
            let mut top = TopK::new(k);
            scan_among(&self.data, query, ids, &mut top);
            top
        } else {
            ids.par_chunks(BLOCK_ROWS)
                .fold(
                    || TopK::new(k),
                    |mut top, ids| {
                        scan_among(&self.data, query, ids, &mut top);
                        top
                    },
                )
                .reduce(|| TopK::new(k), TopK::merge)
        };
        Ok(top.into_sorted())
    }

    /// Removes the rows `rows` (ascending, each once), moving the later rows down in place: the
    /// rows after them take new ids, in order. Fails, removing nothing, on a row not here or
    /// a list not strictly ascending.
    pub fn remove_rows(&mut self, rows: &[usize]) -> Result<()> {
        if let Some(w) = rows.windows(2).find(|w| w[0] >= w[1]) {
            return Err(Error::Input(format!("rows to remove must ascend, each once: {} then {}", w[0], w[1])));
        }
        if let Some(&last) = rows.last().filter(|&&r| r >= self.len()) {
            return Err(Error::Input(format!("row {last} is not in the index, which holds {}", self.len())));
        }
        let dim = self.dim;
        let mut kept = rows.first().map_or(self.len(), |&r| r);
        for (i, &row) in rows.iter().enumerate() {
            let next = rows.get(i + 1).copied().unwrap_or(self.len());
            self.data.copy_within((row + 1) * dim..next * dim, kept * dim);
            kept += next - row - 1;
        }
        self.data.truncate(kept * dim);
        Ok(())
    }

    /// All stored vectors, row-major.
    pub fn as_flat(&self) -> &[f32] {
        &self.data
    }

    fn check_query(&self, query: &[f32]) -> Result<()> {
        if query.len() != self.dim {
            return Err(Error::Input(format!(
                "query has length {}, the index has dimension {}",
                query.len(),
                self.dim
            )));
        }
        if let Some(i) = query.iter().position(|x| !x.is_finite()) {
            return Err(Error::Input(format!("query value {i} is {}, not finite", query[i])));
        }
        Ok(())
    }
}

impl VectorIndex for FlatIndex {
    fn dim(&self) -> usize {
        self.dim
    }

    fn len(&self) -> usize {
        self.data.len() / self.dim
    }

    fn add(&mut self, vector: &[f32]) -> Result<usize> {
        if vector.len() != self.dim {
            return Err(Error::Input(format!(
                "vector has length {}, the index has dimension {}",
                vector.len(),
                self.dim
            )));
        }
        self.extend_from_flat(vector)
    }

    fn search(&self, query: &[f32], k: usize) -> Result<Vec<(usize, f32)>> {
        self.check_query(query)?;
        let k = k.min(self.len());
        if k == 0 {
            return Ok(Vec::new());
        }
        let block = BLOCK_ROWS * self.dim;
        let top = if self.len() < PARALLEL_MIN_ROWS {
            let mut top = TopK::new(k);
            scan(&self.data, query, 0, &mut top);
            top
        } else {
            self.data
                .par_chunks(block)
                .enumerate()
                // One heap per rayon job (not per block), so its threshold carries over.
                .fold(
                    || TopK::new(k),
                    |mut top, (b, rows)| {
                        scan(rows, query, b * BLOCK_ROWS, &mut top);
                        top
                    },
                )
                .reduce(|| TopK::new(k), TopK::merge)
        };
        Ok(top.into_sorted())
    }

    /// Scans each block of stored vectors once for all queries (it stays in cache), in parallel
    /// over blocks.
    fn search_batch(&self, queries: &[f32], k: usize) -> Result<Vec<Vec<(usize, f32)>>> {
        check_matrix(queries, self.dim, "queries")?;
        let n = queries.len() / self.dim;
        let k = k.min(self.len());
        if n == 0 {
            return Ok(Vec::new());
        }
        if k == 0 {
            return Ok(vec![Vec::new(); n]);
        }
        let fresh = || (0..n).map(|_| TopK::new(k)).collect::<Vec<_>>();
        let tops = self
            .data
            .par_chunks(BLOCK_ROWS * self.dim)
            .enumerate()
            .fold(fresh, |mut tops, (b, rows)| {
                for (q, top) in queries.chunks_exact(self.dim).zip(&mut tops) {
                    scan(rows, q, b * BLOCK_ROWS, top);
                }
                tops
            })
            .reduce(fresh, |a, b| a.into_iter().zip(b).map(|(x, y)| x.merge(y)).collect());
        Ok(tops.into_iter().map(TopK::into_sorted).collect())
    }
}

/// Buffers smaller than this (two 2 MiB pages) stay on ordinary pages.
const HUGE_PAGE_MIN_BYTES: usize = 4 << 20;

/// Asks Linux to back `[ptr, ptr + bytes)` (an allocation not yet written) with transparent
/// huge pages where it is at least two of them; elsewhere, or if refused, nothing changes.
#[cfg(target_os = "linux")]
fn advise_huge_pages(ptr: *mut u8, bytes: usize) {
    const HUGE: usize = 2 << 20;
    if bytes < HUGE_PAGE_MIN_BYTES {
        return;
    }
    let start = (ptr as usize).div_ceil(HUGE) * HUGE;
    let end = (ptr as usize + bytes) / HUGE * HUGE;
    if end > start {
        // SAFETY: the range lies inside an allocation we own; madvise only changes how the
        // kernel backs it. Failure is harmless (4 KiB pages are kept).
        unsafe {
            libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
        }
    }
}

#[cfg(not(target_os = "linux"))]
fn advise_huge_pages(_ptr: *mut u8, _bytes: usize) {}

/// Checks that `data` is a whole number of `dim`-long rows of finite values.
fn check_matrix(data: &[f32], dim: usize, what: &str) -> Result<()> {
    if dim == 0 || !data.len().is_multiple_of(dim) {
        return Err(Error::Input(format!("{what} have {} values, not a multiple of the dimension {dim}", data.len())));
    }
    if let Some(i) = data.iter().position(|x| !x.is_finite()) {
        return Err(Error::Input(format!("{what}: row {} value {} is {}, not finite", i / dim, i % dim, data[i])));
    }
    Ok(())
}

/// Offers the rows `ids` of the row-major matrix `data` to `top`.
fn scan_among(data: &[f32], query: &[f32], ids: &[usize], top: &mut TopK) {
    let mut scores = [0f32; BLOCK_ROWS];
    for ids in ids.chunks(BLOCK_ROWS) {
        score_rows(Rows::Picked { data, rows: ids }, query, &mut scores[..ids.len()]);
        for (&id, &score) in ids.iter().zip(&scores) {
            top.offer(Candidate { score, id });
        }
    }
}

/// Offers every row of `rows` (ids from `first_id`) to `top`.
fn scan(rows: &[f32], query: &[f32], first_id: usize, top: &mut TopK) {
    let dim = query.len();
    let mut scores = [0f32; BLOCK_ROWS];
    let mut id = first_id;
    for block in rows.chunks(BLOCK_ROWS * dim) {
        let n = block.len() / dim;
        score_rows(Rows::Block(block), query, &mut scores[..n]);
        for &s in &scores[..n] {
            top.offer(Candidate { score: s, id });
            id += 1;
        }
    }
}

const LANES: usize = 16;

/// How far ahead (in f32 values) the scan asks for rows: software prefetch keeps more memory
/// requests in flight than the hardware streamer, which stops at 4 KiB page boundaries.
const PREFETCH_AHEAD: usize = 2048;

/// Hints the CPU to bring the cache line at `p` into cache. Never faults, even past the end of
/// an allocation, so the address need not be valid.
#[inline(always)]
fn prefetch(p: *const f32) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: prefetch instructions do not access memory architecturally and never fault.
    unsafe {
        std::arch::x86_64::_mm_prefetch(p.cast::<i8>(), std::arch::x86_64::_MM_HINT_T0);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Σ a_i·b_i with 16 independent partial sums (which LLVM turns into SIMD registers), summed
/// in a fixed order at the end. The result is the same on every CPU and in every code path of
/// this module, so scores are reproducible and ties are real ties.
#[inline(always)]
fn dot_lanes(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
    finish(acc, ra, rb)
}

/// Adds the lanes pairwise (8 + 8, 4 + 4, …), then the tail.
#[inline(always)]
fn finish(mut acc: [f32; LANES], ra: &[f32], rb: &[f32]) -> f32 {
    let mut width = LANES / 2;
    while width > 0 {
        for l in 0..width {
            acc[l] += acc[l + width];
        }
        width /= 2;
    }
    let mut tail = 0f32;
    for (x, y) in ra.iter().zip(rb) {
        tail += x * y;
    }
    acc[0] + tail
}

/// The rows a scoring pass reads: a contiguous row-major block, or chosen rows of the index's
/// matrix.
#[derive(Clone, Copy)]
enum Rows<'a> {
    Block(&'a [f32]),
    Picked { data: &'a [f32], rows: &'a [usize] },
}

/// Dot products of `query` with each row of `rows`, four rows at a time so that four
/// independent accumulator sets hide the add latency and each query load serves four rows.
#[inline(always)]
fn score_rows_body(rows: Rows<'_>, query: &[f32], out: &mut [f32]) {
    let dim = query.len();
    match rows {
        Rows::Block(rows) => {
            let mut groups = rows.chunks_exact(4 * dim);
            let mut outs = out.chunks_exact_mut(4);
            for (g, o) in (&mut groups).zip(&mut outs) {
                let (r0, rest) = g.split_at(dim);
                let (r1, rest) = rest.split_at(dim);
                let (r2, r3) = rest.split_at(dim);
                let ahead = [r0, r1, r2, r3].map(|r| r.as_ptr().wrapping_add(PREFETCH_AHEAD));
                o.copy_from_slice(&score4([r0, r1, r2, r3], ahead, query));
            }
            for (r, o) in groups.remainder().chunks_exact(dim).zip(outs.into_remainder()) {
                *o = dot_lanes(r, query);
            }
        }
        Rows::Picked { data, rows } => {
            let row = |i: usize| &data[i * dim..(i + 1) * dim];
            let mut groups = rows.chunks_exact(4);
            let mut outs = out.chunks_exact_mut(4);
            for (n, (g, o)) in (&mut groups).zip(&mut outs).enumerate() {
                // The rows two groups on are fetched while these are scored: the rows between
                // picked ones are not wanted, so the block's fixed look-ahead would waste reads.
                let next = rows.get(4 * n + 8..4 * n + 12).unwrap_or(g);
                let ahead = [0, 1, 2, 3].map(|i| data.as_ptr().wrapping_add(next[i] * dim));
                o.copy_from_slice(&score4([row(g[0]), row(g[1]), row(g[2]), row(g[3])], ahead, query));
            }
            for (&r, o) in groups.remainder().iter().zip(outs.into_remainder()) {
                *o = dot_lanes(row(r), query);
            }
        }
    }
}

/// The dot products of `query` with four rows, each summed lane by lane as [`dot_lanes`] does
/// (so bitwise equal to it), asking for the memory from `ahead` on (one address per row) as
/// they go.
#[inline(always)]
fn score4([r0, r1, r2, r3]: [&[f32]; 4], ahead: [*const f32; 4], query: &[f32]) -> [f32; 4] {
    let dim = query.len();
    let mut acc = [[0f32; LANES]; 4];
    let q = query.chunks_exact(LANES);
    let qr = q.remainder();
    for (j, (((x0, x1), (x2, x3)), y)) in r0
        .chunks_exact(LANES)
        .zip(r1.chunks_exact(LANES))
        .zip(r2.chunks_exact(LANES).zip(r3.chunks_exact(LANES)))
        .zip(q)
        .enumerate()
    {
        for p in ahead {
            prefetch(p.wrapping_add(j * LANES));
        }
        for l in 0..LANES {
            acc[0][l] += x0[l] * y[l];
            acc[1][l] += x1[l] * y[l];
            acc[2][l] += x2[l] * y[l];
            acc[3][l] += x3[l] * y[l];
        }
    }
    let tail = dim - qr.len();
    [
        finish(acc[0], &r0[tail..], qr),
        finish(acc[1], &r1[tail..], qr),
        finish(acc[2], &r2[tail..], qr),
        finish(acc[3], &r3[tail..], qr),
    ]
}

/// [`score_rows_body`] compiled for the best instruction set the CPU has (AVX-512, AVX2, or
/// the build's baseline). No FMA contraction happens in any variant, so all agree bitwise.
fn score_rows(rows: Rows<'_>, query: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f,avx512vl,avx2")]
        unsafe fn avx512(rows: Rows<'_>, query: &[f32], out: &mut [f32]) {
            score_rows_body(rows, query, out)
        }
        #[target_feature(enable = "avx2")]
        unsafe fn avx2(rows: Rows<'_>, query: &[f32], out: &mut [f32]) {
            score_rows_body(rows, query, out)
        }
        if std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("avx512vl") {
            // SAFETY: the CPU supports the features the function was compiled for.
            return unsafe { avx512(rows, query, out) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: as above.
            return unsafe { avx2(rows, query, out) };
        }
    }
    score_rows_body(rows, query, out)
}

/// The inner product [`FlatIndex`] scores with (vectorised; bitwise equal to its scores).
/// Sums only the common prefix if the lengths differ.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    if n == 0 {
        return 0.0;
    }
    let mut out = [0f32];
    score_rows(Rows::Block(&a[..n]), &b[..n], &mut out);
    out[0]
}

/// A scored id. Ordered so that the *greater* candidate is the *worse* one (lower score, then
/// higher id): a `BinaryHeap` of them has the worst kept candidate on top, and ascending order
/// is best first. NaN scores rank below everything.
#[derive(Debug, Clone, Copy)]
struct Candidate {
    score: f32,
    id: usize,
}

fn rank_key(score: f32) -> f32 {
    if score.is_nan() {
        f32::NEG_INFINITY
    } else {
        score
    }
}

impl Ord for Candidate {
    fn cmp(&self, other: &Self) -> Ordering {
        rank_key(other.score).partial_cmp(&rank_key(self.score)).unwrap_or(Ordering::Equal).then(self.id.cmp(&other.id))
    }
}

impl PartialOrd for Candidate {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Candidate {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Candidate {}

/// The best `k` candidates offered so far.
struct TopK {
    k: usize,
    heap: BinaryHeap<Candidate>,
}

impl TopK {
    fn new(k: usize) -> Self {
        Self { k, heap: BinaryHeap::with_capacity(k + 1) }
    }

    #[inline]
    fn offer(&mut self, c: Candidate) {
        if self.heap.len() < self.k {
            self.heap.push(c);
        } else if let Some(mut worst) = self.heap.peek_mut() {
            if c < *worst {
                *worst = c;
            }
        }
    }

    fn merge(mut self, other: TopK) -> TopK {
        if self.heap.len() < other.heap.len() {
            return other.merge(self);
        }
        for c in other.heap {
            self.offer(c);
        }
        self
    }

    fn into_sorted(self) -> Vec<(usize, f32)> {
        self.heap.into_sorted_vec().into_iter().map(|c| (c.id, c.score)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_matches_naive_for_all_lengths() {
        for n in 0..70 {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
            let naive: f64 = a.iter().zip(&b).map(|(&x, &y)| x as f64 * y as f64).sum();
            assert!((dot(&a, &b) as f64 - naive).abs() < 1e-4, "n={n}");
            // Every path of score_rows gives the same bits as dot.
            let rows: Vec<f32> = (0..7).flat_map(|_| a.iter().copied()).collect();
            let mut out = [0f32; 7];
            if n > 0 {
                score_rows(Rows::Block(&rows), &b, &mut out);
                assert!(out.iter().all(|&s| s.to_bits() == dot(&a, &b).to_bits()), "n={n}");
                out = [0f32; 7];
                score_rows(Rows::Picked { data: &rows, rows: &[6, 0, 3, 3, 1, 5, 2] }, &b, &mut out);
                assert!(out.iter().all(|&s| s.to_bits() == dot(&a, &b).to_bits()), "n={n}, picked rows");
            }
        }
    }

    #[test]
    fn heap_keeps_best_with_ties_by_id() {
        let mut top = TopK::new(3);
        for (id, score) in [(0, 1.0), (1, 2.0), (2, 2.0), (3, f32::NAN), (4, 2.0), (5, 0.5)] {
            top.offer(Candidate { score, id });
        }
        assert_eq!(top.into_sorted(), vec![(1, 2.0), (2, 2.0), (4, 2.0)]);
    }
}
