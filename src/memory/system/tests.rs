//! Unit tests of [`crate::memory::system`].

use super::*;

struct Tree(PathBuf);

impl Tree {
    fn new(name: &str) -> Tree {
        let dir = std::env::temp_dir().join(format!(
            "dlx-memory-{name}-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Tree(dir)
    }

    fn write(&self, relative: &str, text: &str) -> &Self {
        let path = self.0.join(relative);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
        self
    }

    fn sources(&self) -> MemorySources {
        MemorySources {
            proc: self.0.join("proc"),
            cgroup: self.0.join("cgroup"),
        }
    }
}

impl Drop for Tree {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

const MEMINFO: &str = "MemTotal:       24683532 kB\nMemFree:        20534184 kB\n";
const RAM: u64 = 24_683_532 * 1024;

#[test]
fn cgroup_v2_lowest_limit_of_the_own_cgroup_and_its_parents() {
    let tree = Tree::new("v2own");
    tree.write("proc/meminfo", MEMINFO)
        .write("proc/self/cgroup", "0::/kubepods/pod1/c1\n")
        .write("cgroup/memory.max", "max\n")
        .write("cgroup/kubepods/pod1/c1/memory.max", "268435456\n");
    assert_eq!(
        tree.sources().limit(),
        Some((268_435_456, LimitSource::CgroupV2))
    );
    tree.write("cgroup/kubepods/pod1/memory.max", "134217728\n");
    assert_eq!(
        tree.sources().limit(),
        Some((134_217_728, LimitSource::CgroupV2))
    );
    tree.write("cgroup/kubepods/pod1/memory.max", "max\n")
        .write("cgroup/kubepods/pod1/c1/memory.max", "max\n");
    assert_eq!(tree.sources().limit(), Some((RAM, LimitSource::TotalRam)));
    tree.write("cgroup/kubepods/pod1/c1/memory.max", "268435456\n");
    assert_eq!(
        tree.sources().limit(),
        Some((268_435_456, LimitSource::CgroupV2))
    );
}

#[test]
fn cgroup_v2_root_as_a_container_sees_it() {
    let tree = Tree::new("v2root");
    tree.write("proc/meminfo", MEMINFO)
        .write("proc/self/cgroup", "0::/\n")
        .write("cgroup/memory.max", "536870912\n");
    assert_eq!(
        tree.sources().limit(),
        Some((536_870_912, LimitSource::CgroupV2))
    );
}

#[test]
fn unlimited_cgroups_fall_back_to_total_ram() {
    let v2 = Tree::new("v2max");
    v2.write("proc/meminfo", MEMINFO)
        .write("proc/self/cgroup", "0::/\n")
        .write("cgroup/memory.max", "max\n");
    assert_eq!(v2.sources().limit(), Some((RAM, LimitSource::TotalRam)));

    let v1 = Tree::new("v1max");
    v1.write("proc/meminfo", MEMINFO)
        .write("proc/self/cgroup", "5:memory:/\n3:cpu,cpuacct:/\n")
        .write(
            "cgroup/memory/memory.limit_in_bytes",
            "9223372036854771712\n",
        );
    assert_eq!(v1.sources().limit(), Some((RAM, LimitSource::TotalRam)));

    let none = Tree::new("nocgroup");
    none.write("proc/meminfo", MEMINFO);
    assert_eq!(none.sources().limit(), Some((RAM, LimitSource::TotalRam)));
}

#[test]
fn cgroup_v1_limit_of_the_memory_controller() {
    let tree = Tree::new("v1");
    tree.write("proc/meminfo", MEMINFO)
        .write(
            "proc/self/cgroup",
            "7:cpu,cpuacct:/docker/abc\n4:blkio,memory:/docker/abc\n",
        )
        .write(
            "cgroup/memory/docker/abc/memory.limit_in_bytes",
            "1073741824",
        );
    assert_eq!(
        tree.sources().limit(),
        Some((1 << 30, LimitSource::CgroupV1))
    );
}

#[test]
fn a_cgroup_limit_above_the_ram_is_the_ram() {
    let tree = Tree::new("aboveram");
    tree.write("proc/meminfo", MEMINFO)
        .write("cgroup/memory.max", &format!("{}\n", RAM * 2));
    assert_eq!(tree.sources().limit(), Some((RAM, LimitSource::TotalRam)));
}

#[test]
fn garbage_and_missing_files_give_no_limit() {
    let tree = Tree::new("garbage");
    tree.write("proc/meminfo", "MemTotal: lots\n")
        .write("proc/self/cgroup", "garbage\n0::/../../etc\n")
        .write("proc/self/statm", "12\n");
    assert_eq!(tree.sources().limit(), None);
    assert_eq!(tree.sources().used(), None);
    assert_eq!(Tree::new("empty").sources().limit(), None);
}

#[test]
fn used_memory_is_resident_pages_times_the_page_size() {
    let tree = Tree::new("statm");
    tree.write("proc/self/statm", "10000 2500 300 10 0 900 0\n");
    assert_eq!(tree.sources().used(), Some(2500 * page_size()));
    // The real file of this test process.
    let real = MemorySources::default()
        .used()
        .expect("RSS of this process");
    assert!(real > 1 << 20, "{real}");
}

#[test]
fn own_cgroup_paths_of_mixed_hierarchies() {
    let text = "12:memory:/user.slice\n1:name=systemd:/user.slice/s\n0::/user.slice/s\n";
    assert_eq!(
        own_cgroup_paths(text),
        (Some("user.slice/s".into()), Some("user.slice".into()))
    );
}
