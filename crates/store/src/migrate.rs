//! Copying a store between backends (folder ⇄ S3 + PostgreSQL, or any pair), verified.
//!
//! Contexts are copied in id order with their ids, metadata, embeddings and state bytes
//! (checked against the source checksum before writing). The copy is resumable: contexts
//! already in the target are skipped, so a killed migration is finished by running it again.
//! Verification then reads every context back from the target: the same row, the same
//! embedding, and state bytes whose checksum matches.
//!
//! With another codec ([`migrate_to`]) each state is decoded and encoded again (f32, bf16,
//! int8, int4), so its bytes and checksum change; verification then checks that every target
//! state is, byte for byte, the conversion of its source state.

use picaso_model::{State, StateDtype};

use crate::error::{Error, Result};
use crate::location::Location;
use crate::records::ContextRecord;
use crate::states::{checksum, key_of};
use crate::store::{Store, StoreInfo};

/// Contexts per batch (one transaction in the target).
const BATCH: usize = 32;

/// What a migration did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct MigrateReport {
    /// Contexts copied now.
    pub copied: u64,
    /// Contexts the target already had.
    pub skipped: u64,
    /// State bytes copied now.
    pub state_bytes: u64,
    /// Contexts read back from the target and checked.
    pub verified: u64,
    /// Wall time in seconds.
    pub seconds: f64,
}

/// Copies `from` into the store at `to` (created for the same model if missing), then
/// verifies the target. `progress(done, total)` is called after each batch.
pub fn migrate(from: &Store, to: Location, progress: impl FnMut(usize, usize)) -> Result<(Store, MigrateReport)> {
    migrate_to(from, to, None, progress)
}

/// The record and bytes of a context's state converted to `codec` (`bytes` as the source
/// holds them, checksum verified when read).
fn convert(r: &ContextRecord, bytes: &[u8], codec: StateDtype) -> Result<(ContextRecord, Vec<u8>)> {
    let state = State::from_bytes(bytes).map_err(|e| Error::Store {
        location: r.state_file.clone(),
        message: format!("context {} cannot be converted: {e}", r.id),
    })?;
    let out = state.to_bytes(codec)?;
    let sum = checksum(&out);
    let record = ContextRecord {
        state_file: format!("states/{}", key_of(&sum)),
        checksum: sum,
        state_bytes: out.len() as u64,
        ..r.clone()
    };
    Ok((record, out))
}

/// [`migrate`], with the target's states in `codec` (default: the source's). Converting
/// decodes each state and encodes it again; to a smaller codec it loses precision, which
/// converting back does not restore.
pub fn migrate_to(
    from: &Store,
    to: Location,
    codec: Option<StateDtype>,
    mut progress: impl FnMut(usize, usize),
) -> Result<(Store, MigrateReport)> {
    let t0 = std::time::Instant::now();
    if from.budget()?.is_some() {
        return Err(Error::Input(format!(
            "store {} keeps a state budget: the states it does not hold cannot be copied as they are. Remove the \
             budget first (`picaso ingest --db {} --state-budget-mb 0 ...` recomputes and stores them), migrate, \
             then set it again on the copy",
            from.location(),
            from.location()
        )));
    }
    let mut info: StoreInfo = from.info().clone();
    let codec = codec.unwrap_or(info.state_dtype);
    let converting = codec != info.state_dtype;
    info.state_dtype = codec;
    let target = Store::open_or_create(to, &info)?;
    target.require_state_dtype(codec)?;
    // A folder target has one writer, like any ingest or delete: without the claim a concurrent
    // delete could remove contexts between the copy and the check.
    let _writer = target.lock_writes()?;
    check_target(from, &target, converting)?;
    if let Some(seg) = from.segmentation()? {
        target.bind_segmentation(&seg)?;
    }
    let total = from.len()?;
    let mut report = MigrateReport::default();
    let mut after = i64::MIN;
    let mut done = 0;
    loop {
        let batch = from.export(after, BATCH)?;
        let Some(last) = batch.last() else { break };
        after = last.0.id;
        let ids: Vec<i64> = batch.iter().map(|(r, _)| r.id).collect();
        let states = from.map_states(&ids)?; // checksums verified here
        let converted: Vec<(ContextRecord, Vec<u8>)> = match converting {
            true => batch.iter().zip(&states).map(|((r, _), s)| convert(r, s.bytes(), codec)).collect::<Result<_>>()?,
            false => Vec::new(),
        };
        let items: Vec<_> = match converting {
            true => batch.iter().zip(&converted).map(|((_, e), (r, b))| (r, e.as_slice(), b.as_slice())).collect(),
            false => batch.iter().zip(&states).map(|((r, e), s)| (r, e.as_slice(), s.bytes())).collect(),
        };
        for ((r, _, bytes), id) in items.iter().zip(target.insert_copies(&items)?) {
            match id {
                Some(_) => {
                    report.copied += 1;
                    report.state_bytes += bytes.len() as u64;
                }
                None => {
                    // check_target saw no conflict; another writer may have made one since.
                    let there = target.id_of(&r.doc, r.seg)?;
                    if there != Some(r.id) {
                        return Err(Error::Input(format!(
                            "target {} now holds ({:?}, segment {}) as {}, not as context {}: another \
                             process wrote to it during the migration; migrate into an empty store",
                            target.location(),
                            r.doc,
                            r.seg,
                            there.map_or("no context".to_string(), |id| format!("context {id}")),
                            r.id
                        )));
                    }
                    report.skipped += 1;
                }
            }
        }
        done += batch.len();
        progress(done, total);
    }
    report.verified = verify_to(from, &target, converting.then_some(codec))?;
    report.seconds = t0.elapsed().as_secs_f64();
    Ok((target, report))
}

/// Refuses, before anything is copied, a target that holds what the source does not: a context
/// whose id, document, segment or state differ from the source's, or another segmentation. A
/// target holding a prefix of the source's contexts (a killed migration) is resumed. When
/// `converting`, states differ by design: [`verify_to`] checks them afterwards.
fn check_target(from: &Store, target: &Store, converting: bool) -> Result<()> {
    let refuse = |why: String| {
        Error::Input(format!(
            "target {} {why}; migrate into an empty store (a new folder or schema)",
            target.location()
        ))
    };
    if let (Some(theirs), Some(ours)) = (target.segmentation()?, from.segmentation()?) {
        if theirs != ours {
            return Err(refuse(format!("holds contexts segmented as {theirs}, the source {ours}")));
        }
    }
    let mut after = i64::MIN;
    loop {
        let batch = target.export(after, BATCH)?;
        let Some(last) = batch.last() else { return Ok(()) };
        after = last.0.id;
        for (t, _) in &batch {
            let same = match from.get(t.id) {
                Ok(r) => r.doc == t.doc && r.seg == t.seg && (converting || r.checksum == t.checksum),
                Err(Error::NotFound(_)) => false,
                Err(e) => return Err(e),
            };
            if !same {
                return Err(refuse(format!(
                    "already holds context {} ({:?}, segment {}), which is not the source's context {}",
                    t.id, t.doc, t.seg, t.id
                )));
            }
        }
    }
}

/// Checks that every context of `from` is in `to` with the same row, embedding and state
/// bytes (read back from `to`'s backend, checksum verified). Returns the number checked.
pub fn verify(from: &Store, to: &Store) -> Result<u64> {
    verify_to(from, to, None)
}

/// [`verify`] of a migration that converted the states to `codec`: each target state must be
/// the source state converted, byte for byte.
pub fn verify_to(from: &Store, to: &Store, codec: Option<StateDtype>) -> Result<u64> {
    let mut after = i64::MIN;
    let mut checked = 0;
    loop {
        let batch = from.export(after, BATCH)?;
        let Some(last) = batch.last() else { break };
        after = last.0.id;
        let ids: Vec<i64> = batch.iter().map(|(r, _)| r.id).collect();
        to.map_states(&ids)?; // every object read back and checked against its checksum
        let sources = match codec {
            Some(_) => from.map_states(&ids)?,
            None => Vec::new(),
        };
        for (i, (r, emb)) in batch.iter().enumerate() {
            let t = to.get(r.id)?;
            let converted;
            let r = match codec {
                Some(codec) => {
                    converted = convert(r, sources[i].bytes(), codec)?.0;
                    &converted
                }
                None => r,
            };
            let same = t.doc == r.doc
                && t.seg == r.seg
                && t.text == r.text
                && t.tokens == r.tokens
                && t.checksum == r.checksum
                && t.state_bytes == r.state_bytes
                && t.metadata == r.metadata;
            if !same || to.embedding(r.id)? != *emb {
                return Err(Error::Store {
                    location: to.location().to_string(),
                    message: format!("context {} differs from the source after copying", r.id),
                });
            }
            checked += 1;
        }
    }
    let (n_from, n_to) = (from.len()?, to.len()?);
    if n_to != n_from {
        return Err(Error::Store {
            location: to.location().to_string(),
            message: format!("holds {n_to} contexts, the source {n_from}; migrate into an empty store"),
        });
    }
    Ok(checked)
}
