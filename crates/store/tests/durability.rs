//! What interrupted or damaged writes leave behind, and how a folder store recovers: ids are
//! never reused (also after copying ids in), a store whose creation was killed says how to
//! remove it, a damaged state file is named with its context and repaired by ingesting its
//! text again, a missing one is found before ingest skips its segment, temporary files of
//! killed writes are swept, a migration claims its target, and a check finds every broken
//! context that a repair then recomputes from its row.

use std::path::Path;

use picaso_model::{Mamba2Config, Mamba2Weights, Model};
use picaso_store::{NewContext, Store};

mod common;
use common::{context, info, insert, model};

/// A new context never gets the id of a deleted one, also in a store that took explicit ids
/// from a migration run again after the delete (a cache keyed by id would serve the deleted
/// context's state).
#[test]
fn ids_are_never_reused_after_a_migration_is_run_again() {
    let tmp = tempfile::tempdir().unwrap();
    let source = Store::open_or_create(tmp.path().join("a").as_path(), &info()).unwrap();
    insert(&source, &[context("d", 0, 0), context("d", 1, 1), context("e", 0, 2)]);
    let to = picaso_store::Location::from(tmp.path().join("b").as_path());
    let (target, _) = picaso_store::migrate(&source, to.clone(), |_, _| {}).unwrap();
    let new = insert(&target, &[context("f", 0, 3)]);
    assert_eq!(new, vec![4]);
    target.delete(4).unwrap();
    drop(target);
    let (target, report) = picaso_store::migrate(&source, to, |_, _| {}).unwrap();
    assert_eq!(report.skipped, 3);
    assert_eq!(insert(&target, &[context("g", 0, 3)]), vec![5], "id 4 was a deleted context's");
}

/// A store left without its metadata by a creation that was killed (older versions wrote the
/// tables and each value in separate steps) is refused with what happened and how to remove it,
/// not a bare SQL error.
#[test]
fn a_store_whose_creation_was_interrupted_says_how_to_remove_it() {
    let tmp = tempfile::tempdir().unwrap();
    let cases: [(&str, &str); 3] = [
        ("empty", ""),
        ("tables", "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);"),
        (
            "dim",
            "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
             CREATE TABLE contexts (id INTEGER PRIMARY KEY AUTOINCREMENT, doc TEXT, seg INTEGER, text TEXT,
                 tokens BLOB, n_tokens INTEGER, embedding BLOB, fingerprint TEXT, state_file TEXT,
                 checksum TEXT, state_bytes INTEGER, created INTEGER, UNIQUE (doc, seg));
             INSERT INTO meta VALUES ('dim', '4'), ('format', 'picaso-store/1');",
        ),
    ];
    for (name, sql) in cases {
        let dir = tmp.path().join(name);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("store.sqlite"), b"").unwrap();
        rusqlite::Connection::open(dir.join("store.sqlite")).unwrap().execute_batch(sql).unwrap();
        for e in [Store::open(dir.as_path()).unwrap_err(), Store::open_or_create(dir.as_path(), &info()).unwrap_err()] {
            let e = e.to_string();
            assert!(e.contains("never finished") && e.contains("store.sqlite*") && e.contains(name), "{name}: {e}");
        }
        // The remedy given works.
        for f in ["store.sqlite", "store.sqlite-wal", "store.sqlite-shm"] {
            let _ = std::fs::remove_file(dir.join(f));
        }
        Store::open_or_create(dir.as_path(), &info()).unwrap();
    }
}

/// Creation writes the database whole: no temporary database is left beside it, and every
/// metadata value is there at once.
#[test]
fn creation_leaves_a_whole_store_and_nothing_else() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("db");
    Store::open_or_create(dir.as_path(), &info()).unwrap();
    let names: Vec<String> =
        std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert!(names.iter().all(|n| !n.starts_with(".store.sqlite")), "{names:?}");
    let conn = rusqlite::Connection::open(dir.join("store.sqlite")).unwrap();
    let mut keys: Vec<String> = conn
        .prepare("SELECT key FROM meta ORDER BY key")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    keys.sort();
    assert_eq!(keys, ["dim", "format", "model", "state_dtype"]);
}

fn state_path(store: &Store, dir: &Path, id: i64) -> std::path::PathBuf {
    dir.join(store.get(id).unwrap().state_file)
}

/// A damaged or missing state file is reported with its context and its repair (`picaso check
/// --repair`, below). Deleting the document and ingesting its text again works too, even when
/// another context still shares the damaged file (its write replaces the file instead of
/// keeping it).
#[test]
fn a_damaged_state_names_its_context_and_is_repaired_by_writing_it_again() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("db");
    let store = Store::open_or_create(dir.as_path(), &info()).unwrap();
    // "a" and "b" hold the same text: one shared state file.
    let ids = insert(&store, &[context("a", 0, 0), context("b", 0, 0), context("c", 0, 1)]);
    let shared = state_path(&store, &dir, ids[0]);
    let mut bytes = std::fs::read(&shared).unwrap();
    let at = bytes.len() - 1;
    bytes[at] ^= 0xff;
    std::fs::write(&shared, &bytes).unwrap();
    let e = store.map_state(ids[0]).unwrap_err().to_string();
    assert!(e.contains("context 1") && e.contains("\"a\"") && e.contains("picaso check --db"), "{e}");
    assert!(e.contains("corrupt"), "{e}");
    // The repair given: delete the document (the file stays, "b" shares it), ingest it again.
    store.delete_document("a").unwrap();
    let again = insert(&store, &[context("a", 0, 0)]);
    store.map_state(again[0]).unwrap();
    store.map_state(ids[1]).unwrap();

    std::fs::remove_file(state_path(&store, &dir, ids[2])).unwrap();
    let e = store.map_state(ids[2]).unwrap_err().to_string();
    assert!(e.contains("context 3") && e.contains("\"c\"") && e.contains("is missing"), "{e}");
    assert!(e.contains("--repair") && e.contains("ingesting that document again") && !e.contains("os error"), "{e}");
    // What ingest does with it (tests/store.rs runs the command): finds it missing, replaces it.
    let c = store.get(ids[2]).unwrap();
    assert_eq!(store.missing_states(std::slice::from_ref(&c)).unwrap(), [ids[2]].into());
    store.delete_if_present(ids[2]).unwrap();
    let again = insert(&store, &[context("c", 0, 1)]);
    store.map_state(again[0]).unwrap();
}

/// Ingest asks which unchanged segments lost their state objects: by one lookup each for a
/// few, by one listing of the location for many; both give the same answer, shared objects
/// included.
#[test]
fn missing_state_objects_are_found_by_lookups_and_by_listing() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("db");
    let store = Store::open_or_create(dir.as_path(), &info()).unwrap();
    // 300 contexts (more than the lookups before a listing), two of them sharing one object.
    let mut items: Vec<NewContext> = (0..299).map(|i| context("many", i, i)).collect();
    items.push(context("same", 0, 7));
    let ids = insert(&store, &items);
    let records: Vec<_> = ids.iter().map(|&id| store.get(id).unwrap()).collect();
    assert!(store.missing_states(&records).unwrap().is_empty());
    assert!(store.missing_states(&records[..5]).unwrap().is_empty());
    for gone in [3, 7] {
        std::fs::remove_file(state_path(&store, &dir, ids[gone])).unwrap();
    }
    let expected: std::collections::HashSet<i64> = [ids[3], ids[7], ids[299]].into();
    assert_eq!(store.missing_states(&records).unwrap(), expected, "by listing");
    let few = [records[2].clone(), records[3].clone(), records[7].clone(), records[299].clone()];
    assert_eq!(store.missing_states(&few).unwrap(), expected, "by lookups");
}

/// Temporary files of writes killed before their rename are removed when a writer next claims
/// the store.
#[test]
fn temporary_files_of_killed_writes_are_swept_by_the_next_writer() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("db");
    let store = Store::open_or_create(dir.as_path(), &info()).unwrap();
    let ids = insert(&store, &[context("a", 0, 0)]);
    let kept = state_path(&store, &dir, ids[0]);
    let shard = kept.parent().unwrap();
    let stale = shard.join(format!(".{}.tmp-999999-0", kept.file_name().unwrap().to_string_lossy()));
    std::fs::write(&stale, b"half a state").unwrap();
    drop(store);
    let store = Store::open(dir.as_path()).unwrap();
    assert!(stale.exists(), "a reader leaves it alone");
    let _writer = store.lock_writes().unwrap();
    assert!(!stale.exists(), "the writer swept it");
    assert!(kept.exists());
    store.map_state(ids[0]).unwrap();
}

/// A migration into a folder store claims it as its writer: while another writer holds it, the
/// migration is refused before it copies anything.
#[test]
fn a_migration_claims_its_folder_target() {
    let tmp = tempfile::tempdir().unwrap();
    let source = Store::open_or_create(tmp.path().join("a").as_path(), &info()).unwrap();
    insert(&source, &[context("d", 0, 0)]);
    let to = tmp.path().join("b");
    let other = Store::open_or_create(to.as_path(), &info()).unwrap();
    let _held = other.lock_writes().unwrap();
    let e = picaso_store::migrate(&source, to.as_path().into(), |_, _| {}).unwrap_err().to_string();
    assert!(e.contains("being written"), "{e}");
    assert!(other.is_empty().unwrap(), "nothing copied");
}

/// A new store is refused a states location that already holds another store's objects: a
/// delete in one would remove objects the other still uses.
#[test]
fn two_stores_cannot_share_a_states_location() {
    let tmp = tempfile::tempdir().unwrap();
    let first = Store::open_or_create(tmp.path().join("a").as_path(), &info()).unwrap();
    insert(&first, &[context("d", 0, 0)]);
    let states = tmp.path().join("a/states");
    let second = picaso_store::Location::parse(tmp.path().join("b").to_str().unwrap(), states.to_str()).unwrap();
    let e = Store::open_or_create(second, &info()).unwrap_err().to_string();
    assert!(e.contains("already holds state objects") && e.contains("its own"), "{e}");
    assert!(!tmp.path().join("b/store.sqlite").exists(), "nothing was created");
    // An empty one is fine, and is claimed at once: a store given it next is refused before
    // the first has written any state there.
    let empty = tmp.path().join("c-states");
    let at =
        |name: &str| picaso_store::Location::parse(tmp.path().join(name).to_str().unwrap(), empty.to_str()).unwrap();
    let third = Store::open_or_create(at("c"), &info()).unwrap();
    assert!(third.state_keys().unwrap().is_empty(), "the marker is not a state object");
    let e = Store::open_or_create(at("d"), &info()).unwrap_err().to_string();
    let c = std::path::absolute(tmp.path().join("c")).unwrap();
    assert!(e.contains(&format!("belongs to the store {}", c.display())) && e.contains("picaso-store.json"), "{e}");
    assert!(!tmp.path().join("d/store.sqlite").exists(), "nothing was created");
    // Its own store opens again; one whose creation failed after the claim is created on the
    // next try (the marker names it).
    drop(third);
    Store::open_or_create(at("c"), &info()).unwrap();
    for f in ["store.sqlite", "store.sqlite-wal", "store.sqlite-shm"] {
        let _ = std::fs::remove_file(tmp.path().join("c").join(f));
    }
    Store::open_or_create(at("c"), &info()).unwrap();
    // The remedy the refusal gives: with the marker removed, the location is free.
    std::fs::remove_dir_all(tmp.path().join("c")).unwrap();
    std::fs::remove_file(empty.join("picaso-store.json")).unwrap();
    Store::open_or_create(at("d"), &info()).unwrap();
}

/// `check` reads every state object back and names each broken context (missing, damaged,
/// shared and damaged, another state's bytes, a damaged row) and each object no context names;
/// `repair` recomputes the broken states from the tokens in their rows, removes the unnamed
/// objects, and leaves only what it cannot fix (the damaged row). A recomputed state with
/// other bits (here: a row whose state was not made from its tokens) is stored under its own
/// checksum, and the row follows it.
#[test]
fn a_check_finds_every_broken_context_and_a_repair_fixes_them() {
    use picaso_store::ProblemKind::{DamagedRow, DamagedState, MissingState};
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("db");
    let store = Store::open_or_create(dir.as_path(), &info()).unwrap();
    let mut other_bits = context("g", 0, 5);
    other_bits.state = context("x", 0, 5).state; // same length of tokens, other tokens
    other_bits.tokens.reverse();
    let items = [
        context("a", 0, 0),
        context("b", 0, 0), // shares a's object
        context("c", 0, 1),
        context("d", 0, 2),
        context("e", 0, 3),
        context("f", 0, 4),
        other_bits,
    ];
    let ids = insert(&store, &items);
    let sound = picaso_store::check(&store, false, |_, _| {}).unwrap();
    assert_eq!((sound.contexts, sound.sound, sound.problems.len(), sound.unreferenced.len()), (7, 7, 0, 0));

    let path = |id| state_path(&store, &dir, id);
    let mut bytes = std::fs::read(path(ids[0])).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 0x40;
    std::fs::write(path(ids[0]), &bytes).unwrap();
    std::fs::remove_file(path(ids[2])).unwrap();
    std::fs::copy(path(ids[4]), path(ids[3])).unwrap(); // a sound state, but not d's
    std::fs::remove_file(path(ids[6])).unwrap();
    let conn = rusqlite::Connection::open(dir.join("store.sqlite")).unwrap();
    conn.execute("UPDATE contexts SET n_tokens = 99 WHERE id = ?1", [ids[5]]).unwrap();
    // An object no row names (a killed delete's), and a file that is not picaso's.
    let orphan = context("o", 0, 9).state.to_bytes(Default::default()).unwrap();
    let orphan_key =
        format!("{}/{}.safetensors", &picaso_store::checksum(&orphan)[..2], picaso_store::checksum(&orphan));
    std::fs::create_dir_all(dir.join("states").join(&orphan_key[..2])).unwrap();
    std::fs::write(dir.join("states").join(&orphan_key), &orphan).unwrap();
    std::fs::create_dir_all(dir.join("states/zz")).unwrap();
    std::fs::write(dir.join("states/zz/notes.safetensors"), b"mine").unwrap();

    let found = picaso_store::check(&store, false, |_, _| {}).unwrap();
    let kinds: Vec<_> = found.problems.iter().map(|p| (p.id, p.kind)).collect();
    assert_eq!(
        kinds,
        [
            (ids[0], DamagedState),
            (ids[1], DamagedState),
            (ids[2], MissingState),
            (ids[3], DamagedState),
            (ids[5], DamagedRow),
            (ids[6], MissingState)
        ]
    );
    assert!(found.problems[0].detail.contains("hash to"), "{:?}", found.problems[0]);
    assert!(found.problems[4].detail.contains("99 tokens"), "{:?}", found.problems[4]);
    assert_eq!((found.contexts, found.sound), (7, 1));
    let unnamed: Vec<&str> = found.unreferenced.iter().map(|u| u.key.as_str()).collect();
    assert_eq!(unnamed, [orphan_key.as_str()]);
    assert_eq!(found.unreferenced_bytes, orphan.len() as u64);
    let line = found.summary();
    assert!(line.contains("1 sound, 2 without their state object, 3 with a damaged state object, 1 with a damaged catalog row; 1 state object that no context names"), "{line}");

    // Without reading: the lost objects and the unnamed one, not the damaged ones.
    let quick = picaso_store::check(&store, true, |_, _| {}).unwrap();
    let missing: Vec<_> = quick.problems.iter().map(|p| (p.id, p.kind)).collect();
    assert_eq!(missing, [(ids[2], MissingState), (ids[5], DamagedRow), (ids[6], MissingState)]);
    assert_eq!((quick.sound, quick.unreferenced.len(), quick.read), (4, 1, false));
    assert!(quick.summary().contains("states only looked for) in"), "{}", quick.summary());
    let fixed = picaso_store::repair(&store, model(), &found, |_, _| {}).unwrap();
    assert_eq!(fixed.rewritten, [ids[0], ids[1], ids[2], ids[3]]);
    assert_eq!(fixed.restated, [ids[6]]);
    assert_eq!((fixed.removed_objects, fixed.removed_bytes), (1, orphan.len() as u64));
    assert_eq!(fixed.left.iter().map(|p| p.id).collect::<Vec<_>>(), [ids[5]]);
    let after = picaso_store::check(&store, false, |_, _| {}).unwrap();
    assert_eq!(after.problems.iter().map(|p| (p.id, p.kind)).collect::<Vec<_>>(), [(ids[5], DamagedRow)]);
    assert_eq!((after.sound, after.unreferenced.len()), (6, 0));
    assert!(dir.join("states/zz/notes.safetensors").exists(), "not picaso's: left alone");
    // The restated context holds the state of its own tokens now.
    let m = model();
    let restated = store.load_state(ids[6]).unwrap();
    assert_eq!(restated, m.prefill(&items[6].tokens, &m.zero_state()).unwrap());
    // A repair needs the store's model.
    let c = Mamba2Config::tiny(2, 4);
    let stranger = Model::from_weights(c.clone(), Mamba2Weights::random(&c, 4), None);
    let e = picaso_store::repair(&store, &stranger, &found, |_, _| {}).unwrap_err().to_string();
    assert!(e.contains("model"), "{e}");
}

/// Stores created at the same instant on one empty `--states` location: exactly one gets it
/// (its marker is written only where none is), the others are refused and create nothing. On a
/// folder, and on S3 where `PICASO_TEST_S3` names a bucket (`eval "$(.ci/services start)"`).
#[test]
fn stores_created_at_once_on_one_states_location_get_it_once() {
    let tmp = tempfile::tempdir().unwrap();
    let mut locations = vec![tmp.path().join("shared-states").to_str().unwrap().to_string()];
    if let Ok(s3) = std::env::var("PICASO_TEST_S3") {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
        locations.push(format!("{}/at-once-{}-{nanos}", s3.trim_end_matches('/'), std::process::id()));
    }
    for (n, states) in locations.iter().enumerate() {
        const RACERS: usize = 6;
        let barrier = std::sync::Barrier::new(RACERS);
        let outcomes: Vec<Result<(), String>> = std::thread::scope(|s| {
            let racers: Vec<_> = (0..RACERS)
                .map(|i| {
                    let (barrier, dir) = (&barrier, tmp.path().join(format!("store-{n}-{i}")));
                    s.spawn(move || {
                        let at = picaso_store::Location::parse(dir.to_str().unwrap(), Some(states)).unwrap();
                        barrier.wait();
                        Store::open_or_create(at, &info()).map(drop).map_err(|e| e.to_string())
                    })
                })
                .collect();
            racers.into_iter().map(|r| r.join().unwrap()).collect()
        });
        let won: Vec<usize> = (0..RACERS).filter(|&i| outcomes[i].is_ok()).collect();
        assert_eq!(won.len(), 1, "{states}: {outcomes:?}");
        let winner = std::path::absolute(tmp.path().join(format!("store-{n}-{}", won[0]))).unwrap();
        for (i, o) in outcomes.iter().enumerate().filter(|(i, _)| *i != won[0]) {
            let e = o.as_ref().unwrap_err();
            assert!(e.contains(&format!("belongs to the store {}", winner.display())), "{e}");
            assert!(!tmp.path().join(format!("store-{n}-{i}/store.sqlite")).exists(), "nothing was created");
        }
    }
}

/// `delete_many` removes every key it names, absent ones included, and nothing else: on a
/// folder, and on S3 where `PICASO_TEST_S3` names a bucket, with more keys than one DeleteObjects
/// request takes (a thousand).
#[test]
fn state_objects_are_removed_many_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    let mut locations = vec![picaso_store::StatesUrl::Local(tmp.path().join("states"))];
    if let Ok(s3) = std::env::var("PICASO_TEST_S3") {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
        let url = format!("{}/delete-many-{}-{nanos}", s3.trim_end_matches('/'), std::process::id());
        locations.push(
            picaso_store::Location::parse(tmp.path().join("db").to_str().unwrap(), Some(&url)).unwrap().states.unwrap(),
        );
    }
    for url in &locations {
        let objects = picaso_store::states::open(url).unwrap();
        let bodies: Vec<Vec<u8>> = (0..1_203u32).map(|i| i.to_le_bytes().to_vec()).collect();
        let keys: Vec<String> =
            bodies.iter().map(|b| picaso_store::states::key_of(&picaso_store::checksum(b))).collect();
        std::thread::scope(|s| {
            for part in 0..4 {
                let (objects, keys, bodies) = (&objects, &keys, &bodies);
                s.spawn(move || (part..keys.len()).step_by(4).for_each(|i| objects.put(&keys[i], &bodies[i]).unwrap()));
            }
        });
        // All but every hundredth, and three keys that were never stored.
        let mut gone: Vec<String> =
            keys.iter().enumerate().filter(|(i, _)| i % 100 != 0).map(|(_, k)| k.clone()).collect();
        gone.extend(["00/absent.safetensors", "ff/absent.safetensors", "ab/absent.safetensors"].map(String::from));
        objects.delete_many(&gone).unwrap();
        let mut left: Vec<String> = keys.iter().step_by(100).cloned().collect();
        left.sort();
        assert_eq!(objects.keys().unwrap(), left, "{url:?}");
        objects.delete_many(&[]).unwrap();
        objects.delete_many(&left).unwrap();
        assert!(objects.keys().unwrap().is_empty(), "{url:?}");
    }
}
