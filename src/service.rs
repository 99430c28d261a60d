//! TODO: service (temporary stub so that main compiles; the real module replaces it).

/// Placeholder: waits for SIGTERM or SIGINT.
pub async fn run(config: crate::config::Config) -> anyhow::Result<()> {
    let _ = config;
    crate::shutdown::wait_for_signal().await?;
    Ok(())
}
