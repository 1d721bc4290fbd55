//! Writing output files so that a failure never leaves a half-written file behind.

use std::io::Write;
use std::path::Path;

use anyhow::Context;

/// Writes `path` by filling a temporary file beside it and renaming it into place.
pub fn write_atomically(path: &Path, fill: impl FnOnce(&mut dyn Write) -> anyhow::Result<()>) -> anyhow::Result<()> {
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = path.file_name().with_context(|| format!("{}: not a file path", path.display()))?;
    let tmp = dir.join(format!(".{}.tmp-{}", name.to_string_lossy(), std::process::id()));
    let result = (|| -> anyhow::Result<()> {
        let file = std::fs::File::create(&tmp).with_context(|| format!("{}: cannot create", tmp.display()))?;
        let mut out = std::io::BufWriter::new(file);
        fill(&mut out)?;
        out.flush().with_context(|| format!("{}: cannot write", tmp.display()))?;
        out.into_inner().map_err(|e| e.into_error())?.sync_all()?;
        std::fs::rename(&tmp, path).with_context(|| format!("{}: cannot move into place", path.display()))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}
