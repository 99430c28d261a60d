//! What the kernel says about this process's memory: the limit it runs under and how much it
//! uses.
//!
//! The limit is the cgroup's: the lowest v2 `memory.max` of the process's own cgroup (from
//! `/proc/self/cgroup`) and its parents up to the cgroup root as the process sees it (a
//! container's own cgroup), or else v1 `memory.limit_in_bytes` of the memory controller; when there is no limit ("max", or v1's page-rounded `i64::MAX`), or it is above
//! the machine's RAM, the total RAM from `/proc/meminfo` is the limit.
//!
//! Used memory is the resident set size (`/proc/self/statm`, resident pages × page size): what
//! the cgroup charges and the OOM killer looks at, whatever allocator holds it. It includes
//! memory the allocator keeps after frees, which is why [`super::release`] hands free memory
//! back to the kernel.
//!
//! The readers take the directories as [`MemorySources`], so tests point them at a temporary
//! tree instead of `/proc` and `/sys/fs/cgroup`.

use std::path::{Path, PathBuf};

/// Where the kernel's files are.
#[derive(Clone, Debug)]
pub struct MemorySources {
    /// `/proc` (reads `self/cgroup`, `self/statm` and `meminfo`).
    pub proc: PathBuf,
    /// `/sys/fs/cgroup`.
    pub cgroup: PathBuf,
}

impl Default for MemorySources {
    fn default() -> Self {
        MemorySources {
            proc: PathBuf::from("/proc"),
            cgroup: PathBuf::from("/sys/fs/cgroup"),
        }
    }
}

/// Where a memory limit came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LimitSource {
    CgroupV2,
    CgroupV1,
    TotalRam,
}

impl LimitSource {
    pub fn as_str(self) -> &'static str {
        match self {
            LimitSource::CgroupV2 => "cgroup v2 memory.max",
            LimitSource::CgroupV1 => "cgroup v1 memory.limit_in_bytes",
            LimitSource::TotalRam => "total RAM (/proc/meminfo)",
        }
    }
}

/// cgroup v1 writes "no limit" as `i64::MAX` rounded down to a page; anything this large is
/// no limit.
const V1_UNLIMITED: u64 = 1 << 62;

impl MemorySources {
    /// The memory limit of this process in bytes, and where it came from; `None` only when
    /// neither a cgroup limit nor `/proc/meminfo` can be read.
    pub fn limit(&self) -> Option<(u64, LimitSource)> {
        let ram = self.total_ram();
        let cgroup = self.cgroup_limit();
        match (cgroup, ram) {
            (Some((limit, source)), Some(ram)) if limit < ram => Some((limit, source)),
            (Some(found), None) => Some(found),
            (_, Some(ram)) => Some((ram, LimitSource::TotalRam)),
            (None, None) => None,
        }
    }

    /// The cgroup's memory limit, if there is one.
    fn cgroup_limit(&self) -> Option<(u64, LimitSource)> {
        let own = std::fs::read_to_string(self.proc.join("self/cgroup")).unwrap_or_default();
        let (v2_path, v1_path) = own_cgroup_paths(&own);
        // v2: the own cgroup and each parent up to the root; the lowest limit applies.
        let mut dirs = vec![self.cgroup.clone()];
        if let Some(path) = v2_path {
            let mut dir = self.cgroup.clone();
            for part in path.split('/').filter(|p| !p.is_empty()) {
                dir.push(part);
                dirs.push(dir.clone());
            }
        }
        let mut v2_seen = false;
        let mut v2_limit: Option<u64> = None;
        for dir in &dirs {
            if let Some(text) = read(&dir.join("memory.max")) {
                v2_seen = true;
                // "max" is no limit at this level.
                if let Some(limit) = parse_bytes(&text) {
                    v2_limit = Some(v2_limit.map_or(limit, |l| l.min(limit)));
                }
            }
        }
        if v2_seen {
            return v2_limit.map(|limit| (limit, LimitSource::CgroupV2));
        }
        let v1_root = self.cgroup.join("memory");
        let v1_dirs = [v1_path.map(|p| v1_root.join(p)), Some(v1_root.clone())];
        for dir in v1_dirs.into_iter().flatten() {
            if let Some(text) = read(&dir.join("memory.limit_in_bytes")) {
                return parse_bytes(&text)
                    .filter(|&limit| limit < V1_UNLIMITED)
                    .map(|limit| (limit, LimitSource::CgroupV1));
            }
        }
        None
    }

    /// `MemTotal` from `/proc/meminfo`, in bytes.
    pub fn total_ram(&self) -> Option<u64> {
        let text = read(&self.proc.join("meminfo"))?;
        meminfo_total(&text)
    }

    /// The resident set size of this process in bytes.
    pub fn used(&self) -> Option<u64> {
        let text = read(&self.proc.join("self/statm"))?;
        statm_resident_pages(&text)?.checked_mul(page_size())
    }
}

fn read(path: &Path) -> Option<String> {
    std::fs::read_to_string(path).ok()
}

fn parse_bytes(text: &str) -> Option<u64> {
    text.trim().parse().ok()
}

/// The relative cgroup paths of this process in `/proc/self/cgroup`: the v2 one (`0::/path`)
/// and the v1 memory controller's (`N:memory:/path` or `N:...,memory,...:/path`). "/" (the
/// root as a container sees it) yields no path: the root is tried anyway.
fn own_cgroup_paths(text: &str) -> (Option<String>, Option<String>) {
    let mut v2 = None;
    let mut v1 = None;
    for line in text.lines() {
        let mut fields = line.splitn(3, ':');
        let (Some(_id), Some(controllers), Some(path)) =
            (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        let relative = path.trim_start_matches('/');
        if relative.is_empty() || relative.split('/').any(|part| part == "..") {
            continue;
        }
        if controllers.is_empty() {
            v2 = Some(relative.to_string());
        } else if controllers.split(',').any(|c| c == "memory") {
            v1 = Some(relative.to_string());
        }
    }
    (v2, v1)
}

/// `MemTotal:  24683532 kB` → bytes.
fn meminfo_total(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let mut fields = line["MemTotal:".len()..].split_whitespace();
    let kib: u64 = fields.next()?.parse().ok()?;
    match fields.next() {
        Some("kB") | None => kib.checked_mul(1024),
        Some(_) => None,
    }
}

/// The second field of `/proc/self/statm`: resident pages.
fn statm_resident_pages(text: &str) -> Option<u64> {
    text.split_whitespace().nth(1)?.parse().ok()
}

fn page_size() -> u64 {
    // SAFETY: sysconf only reads a constant of the running system.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(size).ok().filter(|&s| s > 0).unwrap_or(4096)
}

#[cfg(test)]
mod tests;
