//! Looking after a store's contents: `picaso documents` lists its documents, `picaso contexts`
//! its contexts (all, one document's, or some ids), `picaso delete` removes contexts or whole
//! documents, `picaso check` verifies every state object (and repairs what it can).

use anyhow::Result;
use clap::Args;
use picaso_model::counted;
use serde_json::json;

use crate::args::{DbArgs, ModelArgs};
use crate::demo::snippet;

/// Contexts read from the catalog per round trip when listing a whole store.
const PAGE: usize = 1000;

#[derive(Args)]
pub struct DocumentsArgs {
    #[command(flatten)]
    db: DbArgs,
    /// Print JSON lines: {"id", "contexts", "tokens"} per document.
    #[arg(long)]
    json: bool,
}

/// `picaso documents`: one line per document, in name order.
pub fn documents(a: DocumentsArgs) -> Result<()> {
    let store = picaso_store::Store::open(a.db.location()?)?;
    for d in store.all_documents()? {
        if a.json {
            println!("{}", serde_json::to_string(&d)?);
        } else {
            let metadata = if d.metadata.is_empty() {
                String::new()
            } else {
                format!("  {}", serde_json::Value::Object(d.metadata))
            };
            // Counts right-aligned, nouns left-aligned: the columns line up.
            let column = |n: u64, noun: &str| {
                format!("{n:>8} {:<8}", if n == 1 { noun.to_string() } else { format!("{noun}s") })
            };
            println!("{} {}  {}{metadata}", column(d.contexts, "context"), column(d.tokens, "token"), d.id);
        }
    }
    Ok(())
}

#[derive(Args)]
pub struct ContextsArgs {
    #[command(flatten)]
    db: DbArgs,
    /// Only the contexts of this document, in segment order.
    #[arg(long, conflicts_with = "ids")]
    doc: Option<String>,
    /// Only these contexts (comma-separated ids), in the order given.
    #[arg(long, value_delimiter = ',')]
    ids: Vec<i64>,
    /// Only the contexts whose metadata passes this condition (repeat: all must hold), as
    /// `picaso query --filter` takes it: `lang=en`, `year>=2020`, or a JSON filter.
    #[arg(long = "filter", value_name = "CONDITION", conflicts_with = "ids")]
    filters: Vec<String>,
    /// Print JSON lines: each context's record (id, doc, seg, text, tokens, n_tokens,
    /// state_file, checksum, state_bytes, created, metadata), as `GET /v1/contexts/{id}` gives it.
    #[arg(long)]
    json: bool,
}

/// The error for a document name the store does not hold, with the command that lists them.
fn no_document(store: &picaso_store::Store, db: &DbArgs, doc: &str) -> anyhow::Error {
    anyhow::anyhow!(
        "store {} holds no document {doc:?}; `picaso documents --db {}` lists them",
        store.location(),
        picaso_store::location::redact(&db.db)
    )
}

/// What [`picaso_store::Store::why_none_match`] tells of a filter no context passes, as lines
/// to follow a message (empty when it tells nothing).
pub fn why_none_match(store: &picaso_store::Store, filter: &picaso_store::Filter) -> Result<String> {
    Ok(store.why_none_match(filter)?.iter().map(|why| format!("\n  {why}")).collect())
}

/// `picaso contexts`: one line per context (id, document and segment, tokens, the text's start).
pub fn list(a: ContextsArgs) -> Result<()> {
    let filter = (!a.filters.is_empty()).then(|| picaso_store::Filter::from_args(&a.filters)).transpose()?;
    let store = picaso_store::Store::open(a.db.location()?)?;
    let show = |r: &picaso_store::ContextRecord| -> Result<()> {
        if a.json {
            println!("{}", serde_json::to_string(r)?);
        } else {
            println!("{:>7}  {} #{}  {} tokens  {}", r.id, r.doc, r.seg, r.n_tokens, snippet(&r.text, 60));
        }
        Ok(())
    };
    // An empty listing says why on stderr (stdout stays the records, none).
    let none_match = |within: &str, why: &str| {
        eprintln!(
            "no context{within} of store {} has metadata matching --filter {}{why}",
            store.location(),
            a.filters.join(" --filter ")
        )
    };
    if let Some(doc) = &a.doc {
        let records = store.document(doc)?;
        if records.is_empty() {
            return Err(no_document(&store, &a.db, doc));
        }
        let mut shown = records.iter().filter(|r| filter.as_ref().is_none_or(|f| f.matches(&r.metadata))).peekable();
        if filter.is_some() && shown.peek().is_none() {
            none_match(&format!(" of document {doc:?}"), "");
        }
        shown.try_for_each(show)
    } else if let Some(filter) = &filter {
        let matching = store.matching(filter)?;
        if matching.is_empty() {
            none_match("", &why_none_match(&store, filter)?);
        }
        for ids in matching.chunks(PAGE) {
            // A context deleted since the ids were read is left out.
            store.records(ids)?.iter().flatten().try_for_each(show)?;
        }
        Ok(())
    } else if !a.ids.is_empty() {
        a.ids.iter().try_for_each(|&id| show(&store.get(id)?))
    } else {
        let mut after = i64::MIN;
        loop {
            let page = store.export(after, PAGE)?;
            let Some((last, _)) = page.last() else { return Ok(()) };
            after = last.id;
            page.iter().try_for_each(|(r, _)| show(r))?;
        }
    }
}

#[derive(Args)]
#[command(group(clap::ArgGroup::new("what").required(true).multiple(true).args(["ids", "doc", "filters"])))]
pub struct DeleteArgs {
    #[command(flatten)]
    db: DbArgs,
    /// Contexts to remove (ids, as `picaso contexts` lists them).
    #[arg(value_delimiter = ',')]
    ids: Vec<i64>,
    /// Remove every context of this document (repeatable).
    #[arg(long)]
    doc: Vec<String>,
    /// Remove every context whose metadata passes this condition (repeat: all must hold), as
    /// `picaso query --filter` takes it (`source=old-crawl`, `year<2000`, a JSON filter).
    /// Refused when no context matches.
    #[arg(long = "filter", value_name = "CONDITION")]
    filters: Vec<String>,
    /// Print JSON: `{"deleted": [ids], "store": totals}`.
    #[arg(long)]
    json: bool,
}

/// `picaso delete`: checks that every id and document named is there, then removes them (each
/// context with its state object unless another context shares it).
pub fn delete(a: DeleteArgs) -> Result<()> {
    let filter = (!a.filters.is_empty()).then(|| picaso_store::Filter::from_args(&a.filters)).transpose()?;
    let store = picaso_store::Store::open(a.db.location()?)?;
    // A folder store has one writer: a server holding it would keep serving deleted contexts.
    let _writer = store.lock_writes()?;
    store.require(&a.ids)?;
    let mut ids = a.ids.clone();
    if let Some(filter) = &filter {
        let matching = store.matching(filter)?;
        if matching.is_empty() {
            anyhow::bail!(
                "no context of store {} has metadata matching --filter {}; nothing was removed{}",
                store.location(),
                a.filters.join(" --filter "),
                why_none_match(&store, filter)?
            );
        }
        ids.extend(matching);
    }
    for doc in &a.doc {
        let segments = store.segments_of(doc)?;
        if segments.is_empty() {
            return Err(no_document(&store, &a.db, doc));
        }
        ids.extend(segments.into_values());
    }
    let mut seen = std::collections::HashSet::new();
    ids.retain(|id| seen.insert(*id));
    // Those removed, ascending: one gone already was another writer's delete.
    let ids = store.delete_many(&ids)?;
    let stats = store.stats()?;
    if a.json {
        println!("{}", json!({"deleted": ids, "store": stats}));
    } else {
        println!(
            "deleted {}; the store holds {} from {}",
            counted(ids.len(), "context"),
            counted(stats.contexts, "context"),
            counted(stats.documents, "document")
        );
    }
    Ok(())
}

#[derive(Args)]
pub struct CheckArgs {
    #[command(flatten)]
    db: DbArgs,
    /// Repair what the check finds: recompute each broken context's state from the token ids
    /// in its row (with the store's model, --model) and remove the state objects no context
    /// names.
    #[arg(long)]
    repair: bool,
    /// Read no state object: find missing ones from one listing of the states location (cheap
    /// on S3), not damaged ones.
    #[arg(long)]
    quick: bool,
    #[command(flatten)]
    model: ModelArgs,
    /// Print JSON: the check's report (`read`, `contexts`, `sound`, `state_bytes`, `problems`,
    /// `unreferenced`, ...), with the repair's under `repair`.
    #[arg(long)]
    json: bool,
}

/// Problems listed one per line before "... and N more".
const PROBLEMS_SHOWN: usize = 20;

/// `picaso check`: reads every context's state object back; with `--repair`, fixes what it
/// found. Fails (exit 1) while a context cannot be used.
pub fn check(a: CheckArgs) -> Result<()> {
    if !a.repair && a.model.model.is_some() {
        anyhow::bail!("--model is used only to repair: add --repair, or leave --model out to check");
    }
    let store = picaso_store::Store::open(a.db.location()?)?;
    // Loaded first: a wrong --model fails before the (long) check.
    let model = if a.repair { Some(crate::args::load_model(&a.model, false)?) } else { None };
    let bar = |what: &str| {
        (!a.json).then(|| {
            let bar = indicatif::ProgressBar::new(0);
            bar.set_style(
                indicatif::ProgressStyle::with_template(&format!("{{bar:30}} {{pos}}/{{len}} {what} · ETA {{eta}}"))
                    .expect("valid template"),
            );
            bar
        })
    };
    let progress = |bar: &Option<indicatif::ProgressBar>| {
        let bar = bar.clone();
        move |done: usize, total: usize| {
            if let Some(bar) = &bar {
                bar.set_length(total as u64);
                bar.set_position(done as u64);
            }
        }
    };
    let checking = bar("contexts checked");
    let found = picaso_store::check(&store, a.quick, progress(&checking))?;
    if let Some(bar) = checking {
        bar.finish_and_clear();
    }
    let repaired = match &model {
        Some(model) => {
            let repairing = bar("contexts repaired");
            let r = picaso_store::repair(&store, model, &found, progress(&repairing))?;
            if let Some(bar) = repairing {
                bar.finish_and_clear();
            }
            Some(r)
        }
        None => None,
    };
    let db = picaso_store::location::redact(&a.db.db);
    if a.json {
        println!("{}", picaso_store::report_json(&found, repaired.as_ref()));
    } else {
        println!("{}", found.summary());
        for p in found.problems.iter().take(PROBLEMS_SHOWN) {
            let kind = match p.kind {
                picaso_store::ProblemKind::MissingState => "missing state",
                picaso_store::ProblemKind::DamagedState => "damaged state",
                picaso_store::ProblemKind::DamagedRow => "damaged row",
            };
            println!("  context {} ({:?} #{}): {kind}: {}", p.id, p.doc, p.seg, p.detail);
        }
        if found.problems.len() > PROBLEMS_SHOWN {
            println!("  ... and {} more (--json lists every one)", found.problems.len() - PROBLEMS_SHOWN);
        }
        match &repaired {
            Some(r) => println!("{}", r.summary()),
            None if !found.unreferenced.is_empty() && found.problems.is_empty() => {
                println!("`picaso check --db {db} --repair` removes the state objects no context names")
            }
            None => {}
        }
    }
    let left = repaired.as_ref().map_or(&found.problems, |r| &r.left);
    if left.is_empty() {
        return Ok(());
    }
    let rows: Vec<String> =
        left.iter().filter(|p| p.kind == picaso_store::ProblemKind::DamagedRow).map(|p| p.id.to_string()).collect();
    let states = left.len() - rows.len();
    let mut how = Vec::new();
    if states > 0 {
        how.push(format!(
            "`picaso check --db {db} --repair` recomputes the {} from the token ids in their rows",
            counted(states, "broken state")
        ));
    }
    if !rows.is_empty() {
        how.push(format!(
            "a damaged row cannot be trusted: `picaso delete --db {db} {}`, then ingest their documents again",
            rows.join(",")
        ));
    }
    anyhow::bail!("{} of the store cannot be used; {}", counted(left.len(), "context"), how.join("; "))
}
