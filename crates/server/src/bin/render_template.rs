//! Renders one request's chat template under limits: reads a `picaso_server::render::Job` on
//! stdin, writes the results on stdout. Started by `picaso_server::render::Sandbox`.

fn main() {
    std::process::exit(picaso_server::render::sandbox_main());
}
