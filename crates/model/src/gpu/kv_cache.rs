//! The keys and values of a batch's sequences on a device: per attention layer one pool of
//! tokens, each sequence a region of it (its first token and its room), so a long sequence
//! costs its own room and not every sequence's. A sequence that outgrows its region moves to a
//! new one at the pool's end; when the pool is full, every sequence is repacked into a pool
//! twice as large. The kernels find a sequence's region by its offset, read from device memory
//! at each pass, so a recorded step stays valid while the pools stay where they are
//! ([`KvCache::reserve`] says when they move).

use std::sync::Arc;

use super::{DeviceBuf, Gpu};
use crate::error::{Error, Result};

/// Tokens of room for `need` keys: a power of two, at least 16, so a sequence moves once per
/// doubling.
fn room(need: usize) -> usize {
    need.max(16).next_power_of_two()
}

/// Keys and values of several sequences in every attention layer of a model.
pub(crate) struct KvCache {
    gpu: Arc<dyn Gpu>,
    /// Floats per token (key heads × head width).
    width: usize,
    /// Per attention layer: keys and values, `pool` tokens each.
    layers: Vec<(DeviceBuf, DeviceBuf)>,
    /// Tokens each pool holds.
    pool: usize,
    /// Tokens given out to regions (the next region starts here).
    top: usize,
    /// Per sequence: its region's first token and its room.
    regions: Vec<(usize, usize)>,
    /// Keys each sequence holds (as many in every layer).
    lens: Vec<usize>,
}

impl KvCache {
    /// Room in `layers` layers for sequences holding `held[i]` keys and about to take
    /// `extra[i]` more; the keys are then written with [`KvCache::write`].
    pub(crate) fn new(
        gpu: &Arc<dyn Gpu>,
        width: usize,
        layers: usize,
        held: &[usize],
        extra: &[usize],
    ) -> Result<Self> {
        let mut regions = Vec::with_capacity(held.len());
        let mut top = 0;
        for (n, t) in held.iter().zip(extra) {
            let r = room(n + t);
            regions.push((top, r));
            top += r;
        }
        let mut cache =
            Self { gpu: gpu.clone(), width, layers: Vec::new(), pool: top, top, regions, lens: held.to_vec() };
        cache.layers = (0..layers).map(|_| Ok((cache.buffer(top)?, cache.buffer(top)?))).collect::<Result<_>>()?;
        Ok(cache)
    }

    /// A pool of `tokens` tokens, with a clear error where the device has no room for it.
    fn buffer(&self, tokens: usize) -> Result<DeviceBuf> {
        let bytes = tokens * self.width * 4;
        DeviceBuf::zeroed(&self.gpu, bytes).map_err(|e| {
            Error::Gpu(format!(
                "{e}: the keys and values of {} sequences ({} tokens with their room to grow) take {:.2} GiB per \
                 attention layer; run fewer or shorter sequences at once",
                self.lens.len(),
                tokens,
                2.0 * bytes as f64 / (1u64 << 30) as f64,
            ))
        })
    }

    /// Keys each sequence holds.
    pub(crate) fn lens(&self) -> &[usize] {
        &self.lens
    }

    /// Tokens each pool holds.
    #[cfg(test)]
    pub(crate) fn pool(&self) -> usize {
        self.pool
    }

    /// Layer `l`'s keys and values pools.
    pub(crate) fn layer(&self, l: usize) -> &(DeviceBuf, DeviceBuf) {
        &self.layers[l]
    }

    /// Each sequence's first token in the pools, for the kernels.
    pub(crate) fn offsets(&self) -> Result<Vec<i32>> {
        self.regions
            .iter()
            .map(|&(at, _)| {
                i32::try_from(at).map_err(|_| {
                    Error::Input(format!("a key cache of {at} tokens: the GPU engine holds up to 2^31 per layer"))
                })
            })
            .collect()
    }

    /// Writes sequence `i`'s keys and values in layer `l` (as many as it holds).
    pub(crate) fn write(&self, i: usize, l: usize, keys: &[f32], values: &[f32]) -> Result<()> {
        let at = self.regions[i].0 * self.width;
        self.layers[l].0.write_f32(at, keys)?;
        self.layers[l].1.write_f32(at, values)
    }

    /// Sequence `i`'s keys and values in layer `l`.
    pub(crate) fn read(&self, i: usize, l: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        let (at, n) = (self.regions[i].0 * self.width, self.lens[i] * self.width);
        Ok((self.layers[l].0.read_f32(at, n)?, self.layers[l].1.read_f32(at, n)?))
    }

    /// Counts `extra[i]` more keys in each sequence (written by the pass that reserved them).
    pub(crate) fn advance(&mut self, extra: &[usize]) {
        self.lens.iter_mut().zip(extra).for_each(|(n, &t)| *n += t);
    }

    /// Room for `extra[i]` more keys in each sequence: a sequence that outgrows its region
    /// moves to a new one. Returns whether the pools moved (a recorded step holds their
    /// addresses); on an error the cache is as it was.
    pub(crate) fn reserve(&mut self, extra: &[usize]) -> Result<bool> {
        let grown: Vec<(usize, usize)> = (0..self.lens.len())
            .filter(|&i| self.lens[i] + extra[i] > self.regions[i].1)
            .map(|i| (i, room(self.lens[i] + extra[i])))
            .collect();
        if grown.is_empty() {
            return Ok(false);
        }
        let more: usize = grown.iter().map(|&(_, r)| r).sum();
        if self.top + more <= self.pool {
            for (i, r) in grown {
                let from = self.regions[i].0;
                self.move_keys(i, (from, self.top), None)?;
                self.regions[i] = (self.top, r);
                self.top += r;
            }
            return Ok(false);
        }
        // Repack every sequence into new pools, twice as large (or as large as needed).
        let mut rooms: Vec<usize> = self.regions.iter().map(|&(_, r)| r).collect();
        for &(i, r) in &grown {
            rooms[i] = r;
        }
        let total: usize = rooms.iter().sum();
        let pool = total.max(2 * self.pool);
        let layers =
            (0..self.layers.len()).map(|_| Ok((self.buffer(pool)?, self.buffer(pool)?))).collect::<Result<Vec<_>>>()?;
        let mut regions = Vec::with_capacity(rooms.len());
        let mut top = 0;
        for (i, r) in rooms.into_iter().enumerate() {
            self.move_keys(i, (self.regions[i].0, top), Some(&layers))?;
            regions.push((top, r));
            top += r;
        }
        (self.layers, self.pool, self.top, self.regions) = (layers, pool, top, regions);
        Ok(true)
    }

    /// Copies sequence `i`'s keys and values from token `from` of the pools to token `to` of
    /// `into` (other pools) or of the same pools (a region past every other).
    fn move_keys(&self, i: usize, (from, to): (usize, usize), into: Option<&[(DeviceBuf, DeviceBuf)]>) -> Result<()> {
        let (w, n) = (self.width, self.lens[i]);
        if n == 0 {
            return Ok(());
        }
        for (l, (keys, values)) in self.layers.iter().enumerate() {
            let (k_to, v_to) = into.map_or((keys, values), |pools| (&pools[l].0, &pools[l].1));
            self.gpu.copy(k_to.at(to * w * 4), keys.at(from * w * 4), n * w * 4)?;
            self.gpu.copy(v_to.at(to * w * 4), values.at(from * w * 4), n * w * 4)?;
        }
        Ok(())
    }

    /// Adds a sequence holding `n` keys, written after with [`KvCache::write`]. Returns
    /// whether the pools moved.
    pub(crate) fn push(&mut self, n: usize) -> Result<bool> {
        self.lens.push(0);
        self.regions.push((0, 0));
        let mut extra = vec![0; self.lens.len()];
        extra[self.lens.len() - 1] = n;
        match self.reserve(&extra) {
            Ok(moved) => {
                *self.lens.last_mut().expect("pushed above") = n;
                Ok(moved)
            }
            Err(e) => {
                self.lens.pop();
                self.regions.pop();
                Err(e)
            }
        }
    }

    /// Drops sequence `i`; the last takes its place (its region stays where it is; the
    /// dropped one's is reclaimed at the next repack).
    pub(crate) fn swap_remove(&mut self, i: usize) {
        self.lens.swap_remove(i);
        self.regions.swap_remove(i);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::testing::test_gpu;

    /// Sequences grow, move within the pool and past it, join and leave, and each keeps its
    /// keys; a long sequence does not give the others its room.
    #[test]
    fn sequences_keep_their_keys_as_they_grow_move_join_and_leave() {
        let (gpu, w) = (test_gpu(), 3);
        let keys = |seq: usize, n: usize| -> Vec<f32> { (0..n * w).map(|j| (seq * 1000 + j) as f32).collect() };
        let mut c = KvCache::new(&gpu, w, 2, &[5, 0, 40], &[0, 0, 0]).unwrap();
        assert_eq!(c.pool(), 16 + 16 + 64, "each sequence its own room");
        let mut want: Vec<(usize, usize)> = vec![(0, 5), (1, 0), (2, 40)]; // (key seed, keys held)
        let write_all = |c: &KvCache, want: &[(usize, usize)]| {
            for (i, &(seed, n)) in want.iter().enumerate() {
                for l in 0..2 {
                    c.write(i, l, &keys(seed, n), &keys(seed + 500, n)).unwrap();
                }
            }
        };
        let check = |c: &KvCache, want: &[(usize, usize)], at: &str| {
            assert_eq!(c.lens().len(), want.len(), "{at}");
            for (i, &(seed, n)) in want.iter().enumerate() {
                for l in 0..2 {
                    let (k, v) = c.read(i, l).unwrap();
                    assert_eq!((k, v), (keys(seed, n), keys(seed + 500, n)), "{at}: sequence {i}, layer {l}");
                }
            }
        };
        write_all(&c, &want);
        check(&c, &want, "written");
        // Sequence 0 grows past 16: a bigger region than the pool has left, so a repack.
        assert!(c.reserve(&[20, 0, 0]).unwrap(), "the pool moved");
        check(&c, &want, "repacked");
        let grown_pool = c.pool();
        assert_eq!(grown_pool, 2 * (16 + 16 + 64));
        c.advance(&[20, 0, 0]);
        want[0].1 = 25;
        write_all(&c, &want);
        // Sequence 1 grows within the pool's free room: it moves, the pool stays.
        assert!(!c.reserve(&[0, 17, 0]).unwrap());
        assert_eq!(c.pool(), grown_pool);
        c.advance(&[0, 17, 0]);
        want[1].1 = 17;
        write_all(&c, &want);
        check(&c, &want, "moved within the pool");
        // Leave and join.
        c.swap_remove(0);
        want.swap_remove(0);
        check(&c, &want, "after a leaver");
        c.push(7).unwrap();
        want.push((3, 7));
        write_all(&c, &want);
        check(&c, &want, "after a joiner");
        assert_eq!(c.offsets().unwrap().len(), 3);
    }
}
