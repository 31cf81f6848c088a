//! Small files in batches (`UploadBatch`, `DownloadBatch`): a tree of thousands of
//! small files and a few large ones goes up and comes back identical, with modes and
//! mtimes, in a handful of requests (ferryd's request counter proves the files were
//! batched, not sent one by one); a batch in which some files fail reports exactly
//! those and copies the rest.

use std::fs;

use ferry_client::Client;
use ferry_common::msg::{ServerStats, VerifyRecord};
use ferry_tests::{
    assert_entries, assert_files_equal, assert_no_temp_files, assert_trees_equal, connect,
    ferrytest, make_many_small_files, rcp_args, runtime, test_choice, write_random_file, Env,
    RcpOutput, User,
};

/// A session to ask ferryd for its counters.
struct Counters {
    rt: tokio::runtime::Runtime,
    client: Client,
}

impl Counters {
    fn open(env: &Env) -> Counters {
        let rt = runtime();
        let client = rt
            .block_on(connect(env.server(), test_choice()))
            .expect("a session for Stats");
        Counters { rt, client }
    }

    fn stats(&self) -> ServerStats {
        self.rt.block_on(self.client.server_stats()).expect("Stats")
    }

    /// Requests ferryd dispatched while `run` ran (this session's own Stats excluded).
    fn requests_during(&self, run: impl FnOnce()) -> u64 {
        let before = self.stats().requests;
        run();
        self.stats().requests - before - 1
    }
}

fn json_u64(out: &RcpOutput, key: &str) -> u64 {
    out.json()[key]
        .as_u64()
        .unwrap_or_else(|| panic!("no {key} in {out}"))
}

ferrytest!(
    thousands_of_small_files_go_up_and_down_in_a_few_requests,
    |env| {
        let src = env.local("src");
        let stats = make_many_small_files(&src, 7, 22, 100);
        assert!(stats.files >= 2_000, "{stats:?}");
        let counters = Counters::open(&env);

        let mut out = None;
        let up = counters.requests_during(|| {
            out = Some(env.rcp(rcp_args!["-r", "--json", &src, env.remote("dst")]));
        });
        let out = out.unwrap();
        out.assert_success();
        assert_eq!(json_u64(&out, "files"), stats.files, "{out}");
        assert_eq!(json_u64(&out, "bytes_sent"), stats.bytes, "{out}");
        assert_trees_equal(&src, &env.share("dst"));
        assert_no_temp_files(&env.share(""));
        // One by one, each file would take at least three requests (open, window,
        // commit). In batches: a Stat, a Mkdir and a SetAttr per directory, a few
        // batches, and the files over 64 KiB one by one.
        let dirs = stats.dirs + 1;
        let large = 4;
        let batches = stats.files / 100;
        assert!(
            up <= 1 + 2 * dirs + batches + 3 * large * 2,
            "{up} requests for {} files in {dirs} directories: not batched",
            stats.files
        );

        let back = env.local("back");
        let mut out = None;
        let down = counters.requests_during(|| {
            out = Some(env.rcp(rcp_args!["-r", "--json", env.remote("dst"), &back]));
        });
        let out = out.unwrap();
        out.assert_success();
        assert_eq!(json_u64(&out, "files"), stats.files, "{out}");
        assert_eq!(json_u64(&out, "bytes_sent"), stats.bytes, "{out}");
        assert_trees_equal(&src, &back);
        assert_no_temp_files(&env.local(""));
        // A Stat, a listing per directory, a few batches, the large files one by one.
        assert!(
            down <= 1 + dirs + batches + 3 * large * 2,
            "{down} requests for {} files in {dirs} directories: not batched",
            stats.files
        );
    }
);

ferrytest!(batched_uploads_are_recorded_for_verify, |env| {
    let src = env.local("src");
    let stats = make_many_small_files(&src, 11, 2, 5);
    env.rcp(rcp_args!["-r", &src, env.remote("dst")])
        .assert_success();
    assert_trees_equal(&src, &env.share("dst"));
    // The generator's mtimes are years old (settled), so each commit was recorded: the
    // server's re-read of the files matches the records it took, empty files included.
    let counters = Counters::open(&env);
    for name in [
        "d00/f000.txt",
        "d00/f001.txt",
        "d01/f004.txt",
        "edge-64k.bin",
    ] {
        let path = format!("dst/{name}");
        let report = counters
            .rt
            .block_on(counters.client.verify("data", &path))
            .unwrap_or_else(|e| panic!("Verify {path}: {e}"));
        assert_eq!(report.record, VerifyRecord::Current, "{path}: {report:?}");
        assert_eq!(report.bad_count, 0, "{path}: {report:?}");
    }
    assert!(stats.files > 10);
});

ferrytest!(single_small_files_replace_existing_ones, |env| {
    for (name, len, seed) in [("a.txt", 10, 1), ("b.txt", 0, 2), ("c.txt", 5000, 3)] {
        write_random_file(&env.local(name), len, seed);
        write_random_file(&env.share(name), 99, seed + 10);
    }
    env.rcp(rcp_args![
        env.local("a.txt"),
        env.local("b.txt"),
        env.local("c.txt"),
        env.remote("")
    ])
    .assert_success();
    for name in ["a.txt", "b.txt", "c.txt"] {
        assert_files_equal(&env.local(name), &env.share(name));
        ferry_tests::assert_same_mode_and_mtime(&env.local(name), &env.share(name));
    }
    // Downloaded over existing local files, under another name.
    write_random_file(&env.local("a.copy"), 1234, 4);
    env.rcp(rcp_args![env.remote("a.txt"), env.local("a.copy")])
        .assert_success();
    assert_files_equal(&env.local("a.txt"), &env.local("a.copy"));
    assert_no_temp_files(&env.local(""));
    assert_no_temp_files(&env.share(""));
});

ferrytest!(an_upload_batch_reports_only_its_failing_files, |env| {
    let src = env.local("t");
    fs::create_dir_all(src.join("sub")).unwrap();
    for i in 0..20 {
        write_random_file(&src.join(format!("sub/f{i:02}.txt")), 100 + i, i);
    }
    // On the server, directories stand where two of the files go.
    fs::create_dir_all(env.share("t/sub/f03.txt")).unwrap();
    fs::create_dir_all(env.share("t/sub/f17.txt/inner")).unwrap();

    let out = env.rcp(rcp_args!["-r", "--json", &src, env.remote("")]);
    out.assert_code(4)
        .assert_error_line(env.remote("t/sub/f03.txt"), &["directory"])
        .assert_error_line(env.remote("t/sub/f17.txt"), &["directory"]);
    let json = out.json();
    assert_eq!(json["errors"].as_array().unwrap().len(), 2, "{out}");
    assert_eq!(json["files"], 18, "{out}");
    for i in (0..20).filter(|i| ![3, 17].contains(i)) {
        let name = format!("sub/f{i:02}.txt");
        assert_files_equal(&src.join(&name), &env.share(&format!("t/{name}")));
    }
    assert!(env.share("t/sub/f03.txt").is_dir());
    assert_no_temp_files(&env.share(""));
});

ferrytest!(
    a_read_only_share_fails_every_file_of_a_batch,
    shares = [("data", false), ("ro", true)],
    |env| {
        for name in ["a", "b"] {
            write_random_file(&env.local(name), 50, 9);
        }
        let out = env.rcp(rcp_args![
            env.local("a"),
            env.local("b"),
            env.remote_in("ro", "")
        ]);
        out.assert_code(4)
            .assert_error_line(env.remote_in("ro", "a"), &["read-only"])
            .assert_error_line(env.remote_in("ro", "b"), &["read-only"]);
        assert_entries(&env.share_dir("ro"), &[]);
    }
);

ferrytest!(a_download_batch_reports_only_its_failing_files, |env| {
    fs::create_dir_all(env.share("t")).unwrap();
    for i in 0..10 {
        write_random_file(&env.share(&format!("t/f{i}.txt")), 300 + i, i);
    }
    // Locally, a directory stands where one file goes.
    fs::create_dir_all(env.local("t/f4.txt/inner")).unwrap();
    let out = env.rcp(rcp_args!["-r", "--json", env.remote("t"), env.local("")]);
    out.assert_code(5)
        .assert_error_line(env.local("t/f4.txt"), &[]);
    assert_eq!(out.json()["files"], 9, "{out}");
    for i in (0..10).filter(|&i| i != 4) {
        let name = format!("t/f{i}.txt");
        assert_files_equal(&env.share(&name), &env.local(&name));
    }
    assert!(env.local("t/f4.txt/inner").is_dir());
    assert_no_temp_files(&env.local(""));
});

#[test]
fn a_download_batch_skips_files_the_server_cannot_read() {
    let user = match User::unprivileged() {
        Ok(u) => u,
        Err(why) => {
            eprintln!("a_download_batch_skips_files_the_server_cannot_read: skipped: {why}");
            return;
        }
    };
    let env = Env::builder().server_user(user).start();
    fs::create_dir_all(env.share("t")).unwrap();
    for i in 0..6 {
        write_random_file(&env.share(&format!("t/f{i}.txt")), 700 + i, i);
    }
    ferry_tests::set_mode(&env.share("t/f2.txt"), 0o000);
    let out = env.rcp(rcp_args!["-r", env.remote("t"), env.local("")]);
    out.assert_code(4).assert_error_line(
        env.remote("t/f2.txt"),
        &["permission denied", "not permitted"],
    );
    assert_entries(
        &env.local("t"),
        &["f0.txt", "f1.txt", "f3.txt", "f4.txt", "f5.txt"],
    );
    for i in [0, 1, 3, 4, 5] {
        let name = format!("t/f{i}.txt");
        assert_files_equal(&env.share(&name), &env.local(&name));
    }
    assert_no_temp_files(&env.local(""));
}
