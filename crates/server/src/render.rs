//! Templates rendered under a budget. A Jinja template is a program: a chat template in a
//! request can loop 10^8 times or build a string of terabytes. So every render, trusted or not,
//! runs with minijinja's fuel (instructions executed) and a cap on the bytes it writes, checked
//! as it writes; and a template that comes with a request renders in a child process with its
//! own memory, CPU and wall-clock limits ([`Sandbox`]), because fuel counts instructions, not
//! bytes: `{% set s = s ~ s %}` forty times is eighty instructions and a terabyte. A bomb then
//! costs a child, never the server.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use minijinja::{Environment, ErrorKind};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::sync::Semaphore;

use crate::error::ApiError;

/// What one render may spend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Budget {
    /// minijinja instructions. The chat templates of Granite 4.0, Nemotron-H, Jamba and ChatML
    /// take 3,000 to 20,000 at 100 messages (tests/templates.rs measures them), so real
    /// conversations render with room to spare; a nested loop of 10^4 × 10^4 stops within
    /// a fraction of a second.
    pub fuel: u64,
    /// Bytes of rendered text (the prompt); checked on each write, so a huge string is refused
    /// before it is copied.
    pub max_bytes: usize,
}

impl Budget {
    /// The fuel of every render.
    pub const FUEL: u64 = 2_000_000;
    /// The rendered prompt's largest size: more than any prompt the server takes (a 10 MB
    /// body's text), far less than a bomb.
    pub const MAX_BYTES: usize = 16 << 20;
}

impl Default for Budget {
    fn default() -> Self {
        Self { fuel: Self::FUEL, max_bytes: Self::MAX_BYTES }
    }
}

/// Why a render failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum RenderError {
    /// The template does not compile.
    Syntax(String),
    /// It ran out of fuel.
    Fuel(u64),
    /// It wrote more than the budget's bytes.
    TooLarge(usize),
    /// It raised an error of its own (`raise_exception`) or failed on these values.
    Failed(String),
}

impl std::fmt::Display for RenderError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Syntax(e) => write!(f, "the chat template does not compile: {e}"),
            Self::Fuel(n) => write!(
                f,
                "the chat template ran more than {n} instructions (its budget) on these messages; \
                 a template that loops over its input more than a few times, or a very long conversation, ends here"
            ),
            Self::TooLarge(n) => {
                write!(f, "the chat template wrote more than {} MiB (the rendered prompt's limit)", n >> 20)
            }
            Self::Failed(e) => write!(f, "the chat template could not render these messages: {e}"),
        }
    }
}

impl From<RenderError> for ApiError {
    fn from(e: RenderError) -> Self {
        ApiError::bad_request(e.to_string())
    }
}

/// A Jinja environment as transformers' `apply_chat_template` has it (blocks trimmed and
/// left-stripped, `raise_exception`, Python's string and dict methods, `strftime_now`), with
/// `budget`'s fuel.
pub fn environment(budget: Budget) -> Environment<'static> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_fuel(Some(budget.fuel));
    minijinja_contrib::add_to_environment(&mut env);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", |message: String| -> Result<String, minijinja::Error> {
        Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
    });
    // transformers gives templates today's date this way (Llama 3 and Granite templates print it).
    env.add_function("strftime_now", |format: String| {
        let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        strftime(&format, secs as i64)
    });
    env
}

/// `format` (Python's strftime codes %Y %m %d %B %b %H %M %S %%; others kept as written) for the
/// UTC time `secs` after the Unix epoch.
fn strftime(format: &str, secs: i64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    // Days to a civil date (Howard Hinnant's algorithm).
    let z = secs.div_euclid(86_400) + 719_468;
    let (era, doe) = (z.div_euclid(146_097), z.rem_euclid(146_097));
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let time = secs.rem_euclid(86_400);
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('B') => out.push_str(MONTHS[(month - 1) as usize]),
            Some('b') => out.push_str(&MONTHS[(month - 1) as usize][..3]),
            Some('H') => out.push_str(&format!("{:02}", time / 3600)),
            Some('M') => out.push_str(&format!("{:02}", time / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", time % 60)),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Checks that `source` compiles.
pub fn compile(source: &str) -> Result<(), RenderError> {
    environment(Budget::default())
        .template_from_str(source)
        .map(|_| ())
        .map_err(|e| RenderError::Syntax(format!("{e:#}")))
}

/// Text written up to a limit: the write that would cross it fails, so the render stops there.
struct Capped {
    out: Vec<u8>,
    max: usize,
}

impl std::io::Write for Capped {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.out.len() + buf.len() > self.max {
            return Err(std::io::Error::other("over the rendered prompt's limit"));
        }
        self.out.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Renders `source` with `context` in this process, within `budget`. For templates the server
/// trusts (the model's own and `--chat-template`); a request's template goes to a [`Sandbox`].
pub fn render(source: &str, context: &Value, budget: Budget) -> Result<String, RenderError> {
    render_counted(source, context, budget).map(|(text, _)| text)
}

/// [`render`], with the fuel it took.
pub fn render_counted(source: &str, context: &Value, budget: Budget) -> Result<(String, u64), RenderError> {
    let env = environment(budget);
    let template = env.template_from_str(source).map_err(|e| RenderError::Syntax(format!("{e:#}")))?;
    let mut out = Capped { out: Vec::new(), max: budget.max_bytes };
    let fuel = match template.render_captured_to(context, &mut out) {
        Ok(captured) => captured.state().fuel_levels().map_or(0, |(used, _)| used),
        Err(e) if e.kind() == ErrorKind::OutOfFuel => return Err(RenderError::Fuel(budget.fuel)),
        Err(e) if e.kind() == ErrorKind::WriteFailure => return Err(RenderError::TooLarge(budget.max_bytes)),
        Err(e) => return Err(RenderError::Failed(format!("{e:#}"))),
    };
    let text = String::from_utf8(out.out).map_err(|e| RenderError::Failed(e.to_string()))?;
    Ok((text, fuel))
}

/// What a sandboxed render is given: one template and the contexts to render it with, each
/// within `budget`.
#[derive(Debug, Serialize, Deserialize)]
pub struct Job {
    /// The template's source.
    pub source: String,
    /// What each render may spend.
    pub budget: Budget,
    /// The child's limits, which it sets on itself before reading anything else.
    pub limits: SandboxLimits,
    /// One context per render.
    pub contexts: Vec<Value>,
}

/// A child's limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxLimits {
    /// Address space, bytes (RLIMIT_AS): an allocation past it fails and the child aborts.
    pub memory_bytes: u64,
    /// CPU seconds (RLIMIT_CPU).
    pub cpu_seconds: u64,
    /// Milliseconds from start to answer, after which the server kills the child.
    pub wall_ms: u64,
}

impl Default for SandboxLimits {
    fn default() -> Self {
        Self { memory_bytes: 512 << 20, cpu_seconds: 2, wall_ms: 2000 }
    }
}

/// Renders request templates in child processes: a program (the `picaso` binary itself, run as
/// `picaso render-template`) that reads a [`Job`] on stdin, calls [`sandbox_main`], and writes
/// its answers on stdout. At most `slots` children run at once, so bombs cost at most
/// `slots × memory_bytes` of the machine, and never the server's own memory.
#[derive(Debug, Clone)]
pub struct Sandbox {
    program: PathBuf,
    args: Vec<String>,
    limits: SandboxLimits,
    slots: Arc<Semaphore>,
}

impl Sandbox {
    /// Children run as `program args…`.
    pub fn new(program: PathBuf, args: Vec<String>, limits: SandboxLimits, slots: usize) -> Self {
        Self { program, args, limits, slots: Arc::new(Semaphore::new(slots.max(1))) }
    }

    /// The child's limits.
    pub fn limits(&self) -> SandboxLimits {
        self.limits
    }

    /// Renders `source` with each of `contexts` in a child, within `budget`: one result per
    /// context. Err when the child could not answer (over its memory or time, or not started).
    pub async fn render(
        &self,
        source: &str,
        contexts: Vec<Value>,
        budget: Budget,
    ) -> Result<Vec<Result<String, RenderError>>, ApiError> {
        use tokio::io::AsyncWriteExt;
        let wall = Duration::from_millis(self.limits.wall_ms);
        let started = Instant::now();
        let _slot = match tokio::time::timeout(wall, self.slots.acquire()).await {
            Ok(Ok(slot)) => slot,
            Ok(Err(_)) => return Err(ApiError::internal("server shutting down")),
            Err(_) => {
                return Err(ApiError::busy("every chat-template sandbox is busy rendering; retry in a moment", 1))
            }
        };
        let job = Job { source: source.to_string(), budget, limits: self.limits, contexts };
        let input = serde_json::to_vec(&job).map_err(|e| ApiError::internal(e.to_string()))?;
        let mut child = tokio::process::Command::new(&self.program)
            .args(&self.args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| {
                ApiError::internal(format!("cannot start the chat-template sandbox {}: {e}", self.program.display()))
            })?;
        let mut stdin = child.stdin.take().expect("piped");
        let run = async move {
            // A child that dies early closes its stdin: its exit status says why.
            let _ = stdin.write_all(&input).await;
            drop(stdin);
            child.wait_with_output().await
        };
        let left = wall.saturating_sub(started.elapsed());
        let output = match tokio::time::timeout(left, run).await {
            Ok(Ok(output)) => output,
            Ok(Err(e)) => return Err(ApiError::internal(format!("the chat-template sandbox failed: {e}"))),
            // Dropping the future kills the child (kill_on_drop).
            Err(_) => return Err(ApiError::bad_request(self.over_time())),
        };
        if !output.status.success() {
            let stderr = String::from_utf8_lossy(&output.stderr);
            return Err(ApiError::bad_request(self.why_failed(&output.status, &stderr)));
        }
        let answer: Vec<Result<String, RenderError>> = serde_json::from_slice(&output.stdout)
            .map_err(|e| ApiError::internal(format!("the chat-template sandbox answered garbage: {e}")))?;
        Ok(answer)
    }

    fn over_time(&self) -> String {
        format!(
            "the request's chat template ran longer than {} ms (the limit for templates sent with a request)",
            self.limits.wall_ms
        )
    }

    /// A child that did not exit cleanly: over its memory (allocation failed, abort) or CPU
    /// time (SIGXCPU, SIGKILL).
    fn why_failed(&self, status: &std::process::ExitStatus, stderr: &str) -> String {
        if stderr.contains("memory allocation of") {
            return format!(
                "the request's chat template needed more than {} MiB (the limit for templates sent with a request)",
                self.limits.memory_bytes >> 20
            );
        }
        #[cfg(unix)]
        {
            use std::os::unix::process::ExitStatusExt;
            if matches!(status.signal(), Some(libc::SIGXCPU) | Some(libc::SIGKILL)) {
                return self.over_time();
            }
        }
        let last = stderr.lines().last().unwrap_or("").chars().take(300).collect::<String>();
        format!("the request's chat template could not render ({status}): {last}")
    }
}

/// The child's side of a [`Sandbox`]: sets its limits on itself, reads a [`Job`] from stdin,
/// renders, writes the results as JSON to stdout. Returns the exit code.
pub fn sandbox_main() -> i32 {
    use std::io::{Read, Write};
    // The job is read first: the parent wrote it (its size is a request body's), so it is
    // trusted to say what the limits are. The template runs under them.
    let mut input = Vec::new();
    if let Err(e) = std::io::stdin().read_to_end(&mut input) {
        eprintln!("picaso render-template: cannot read the job: {e}");
        return 2;
    }
    let job: Job = match serde_json::from_slice(&input) {
        Ok(job) => job,
        Err(e) => {
            eprintln!("picaso render-template: the job is not JSON ({e}); this command is run by `picaso serve`");
            return 2;
        }
    };
    drop(input);
    if let Err(e) = limit_self(job.limits) {
        eprintln!("picaso render-template: cannot set limits: {e}");
        return 2;
    }
    let results: Vec<Result<String, RenderError>> =
        job.contexts.iter().map(|c| render(&job.source, c, job.budget)).collect();
    let mut out = std::io::stdout().lock();
    match serde_json::to_writer(&mut out, &results).and_then(|()| out.flush().map_err(serde_json::Error::io)) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("picaso render-template: cannot write the results: {e}");
            2
        }
    }
}

/// Sets this process's address-space and CPU-time limits.
#[cfg(unix)]
fn limit_self(limits: SandboxLimits) -> std::io::Result<()> {
    let set = |resource, soft: u64, hard: u64| {
        let limit = libc::rlimit { rlim_cur: soft as libc::rlim_t, rlim_max: hard as libc::rlim_t };
        // SAFETY: setrlimit reads the struct we pass; it changes only this process's limits.
        if unsafe { libc::setrlimit(resource, &limit) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    };
    set(libc::RLIMIT_AS, limits.memory_bytes, limits.memory_bytes)?;
    // SIGXCPU at the soft limit, SIGKILL a second later.
    set(libc::RLIMIT_CPU, limits.cpu_seconds, limits.cpu_seconds + 1)
}

/// Elsewhere only the parent's wall-clock deadline holds.
#[cfg(not(unix))]
fn limit_self(_limits: SandboxLimits) -> std::io::Result<()> {
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ctx() -> Value {
        json!({"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": true})
    }

    /// Dates as Python's strftime prints them (2024-02-29 12:34:56 UTC is 1709210096).
    #[test]
    fn strftime_prints_dates_as_python_does() {
        assert_eq!(strftime("%d %B %Y, %b %m %H:%M:%S %% %j", 1_709_210_096), "29 February 2024, Feb 02 12:34:56 % %j");
        assert_eq!(strftime("%Y-%m-%d", 0), "1970-01-01");
        assert_eq!(render("{{ strftime_now('%Y') }}", &ctx(), Budget::default()).unwrap().len(), 4);
    }

    /// Loops past the fuel, output past the cap, and a template's own error each give their
    /// own refusal; a plain template renders.
    #[test]
    fn budgets_refuse_what_they_should() {
        let small = Budget { fuel: 10_000, max_bytes: 1000 };
        let bomb = "{% for i in range(10000) %}{% for j in range(10000) %}x{% endfor %}{% endfor %}";
        let wide_enough = Budget { max_bytes: 1 << 20, ..small };
        assert_eq!(render(bomb, &ctx(), wide_enough), Err(RenderError::Fuel(10_000)));
        let wide = "{{ 'x' * 5000 }}";
        assert_eq!(render(wide, &ctx(), small), Err(RenderError::TooLarge(1000)));
        // Many small writes stop at the cap too.
        let many = "{% for i in range(900) %}xy{% endfor %}";
        assert_eq!(render(many, &ctx(), small), Err(RenderError::TooLarge(1000)));
        assert!(matches!(render("{% for %}", &ctx(), small), Err(RenderError::Syntax(_))));
        assert!(
            matches!(render("{{ raise_exception('no') }}", &ctx(), small), Err(RenderError::Failed(m)) if m.contains("no"))
        );
        assert_eq!(render("{{ messages[0].content }}!", &ctx(), small).unwrap(), "hi!");
    }
}
