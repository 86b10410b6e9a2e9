//! Launch shapes: how a batch of sequences maps onto grids and blocks, and which scan runs.
//! Pure host arithmetic, tested without a device.

/// Threads per block of the row-wise kernels.
pub(crate) const BLOCK: u32 = 256;

/// Tokens per chunk of the chunked scan (the kernels' shared arrays hold 64).
pub(crate) const CHUNK: usize = 64;

/// Sequences at most this long run the token-by-token scan: one pass over the state per token
/// beats the chunked form's three launches and scratch for decode steps and short prompts.
pub(crate) const STEP_SCAN_UP_TO: usize = 8;

/// Blocks of [`BLOCK`] threads that cover `n` items.
pub(crate) fn blocks(n: usize) -> u32 {
    u32::try_from(n.div_ceil(BLOCK as usize).max(1)).expect("a grid dimension fits in u32")
}

/// The token-by-token scan's block: `headdim` rows of state, each shared by the returned
/// number of threads (a power of two, so the block is at most 256 threads when `headdim`
/// divides 256, and never more than 1024).
pub(crate) fn scan_threads_per_row(headdim: usize, d_state: usize) -> usize {
    let mut tpr = 1;
    while tpr * 2 * headdim <= BLOCK as usize && tpr * 2 <= d_state {
        tpr *= 2;
    }
    tpr
}

/// How one forward pass lays out its sequences.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Batch {
    /// First row of each sequence.
    pub starts: Vec<i32>,
    /// Rows of each sequence.
    pub lens: Vec<i32>,
    /// Rows in all.
    pub rows: usize,
    /// The longest sequence.
    pub max_len: usize,
}

impl Batch {
    /// The layout of sequences of `lens` tokens packed one after another.
    pub(crate) fn new(lens: &[usize]) -> Self {
        let mut starts = Vec::with_capacity(lens.len());
        let mut at = 0usize;
        for &l in lens {
            starts.push(i32::try_from(at).expect("rows fit in i32"));
            at += l;
        }
        Self {
            starts,
            lens: lens.iter().map(|&l| i32::try_from(l).expect("rows fit in i32")).collect(),
            rows: at,
            max_len: lens.iter().copied().max().unwrap_or(0),
        }
    }
    /// Sequences in the batch.
    pub(crate) fn seqs(&self) -> usize {
        self.lens.len()
    }
    /// Whether the token-by-token scan runs (every sequence short).
    pub(crate) fn step_scan(&self) -> bool {
        self.max_len <= STEP_SCAN_UP_TO
    }
    /// Refuses more sequences than a grid dimension holds.
    pub(crate) fn check_grid(&self) -> crate::error::Result<()> {
        if self.seqs() > 65_535 {
            return Err(crate::error::Error::Input(format!(
                "{} sequences in one pass: the GPU engine runs at most 65,535 at once (a grid dimension); split the batch",
                self.seqs()
            )));
        }
        Ok(())
    }
    /// Chunks of the longest sequence.
    pub(crate) fn max_chunks(&self) -> usize {
        self.max_len.div_ceil(CHUNK)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_cover_every_item_and_never_launch_an_empty_grid() {
        assert_eq!(blocks(0), 1);
        assert_eq!(blocks(1), 1);
        assert_eq!(blocks(256), 1);
        assert_eq!(blocks(257), 2);
        assert_eq!(blocks(10_000), 40);
    }

    #[test]
    fn the_step_scan_block_is_a_power_of_two_within_limits() {
        for (p, n, tpr) in [(64, 128, 4), (16, 16, 16), (16, 4, 4), (8, 8, 8), (256, 128, 1), (512, 64, 1), (3, 64, 64)]
        {
            let got = scan_threads_per_row(p, n);
            assert_eq!(got, tpr, "headdim {p}, d_state {n}");
            assert!(got.is_power_of_two() && got <= n.max(1) && p * got <= 1024.max(p));
        }
    }

    #[test]
    fn a_batch_packs_its_sequences_and_picks_the_scan_by_its_longest() {
        let b = Batch::new(&[3, 1, 130]);
        assert_eq!(b.starts, [0, 3, 4]);
        assert_eq!(b.lens, [3, 1, 130]);
        assert_eq!((b.rows, b.max_len, b.seqs()), (134, 130, 3));
        assert_eq!(b.max_chunks(), 3);
        assert!(!b.step_scan());
        let decode = Batch::new(&[1; 16]);
        assert!(decode.step_scan());
        assert_eq!(decode.max_chunks(), 1);
    }
}
