//! Where a copy lands (cp/scp semantics): into an existing directory under the source's
//! basename, or under a new name; several sources need an existing directory.

use std::fs;

use ferry_tests::{
    assert_entries, assert_files_equal, assert_no_temp_files, ferrytest, mode_of, mtime_of,
    rcp_args, set_mode, set_mtime, write_random_file, Env, MIB,
};

/// Writes local files `names` with distinct random contents of different sizes.
fn local_files(env: &Env, names: &[&str]) {
    for (i, name) in names.iter().enumerate() {
        write_random_file(&env.local(name), 1000 + i as u64 * MIB / 2, 10 + i as u64);
    }
}

ferrytest!(upload_into_existing_dir_with_trailing_slash, |env| {
    local_files(&env, &["f.bin"]);
    fs::create_dir(env.share("dir")).unwrap();
    env.rcp(rcp_args![env.local("f.bin"), env.remote("dir/")])
        .assert_success();
    assert_entries(&env.share(""), &["dir"]);
    assert_entries(&env.share("dir"), &["f.bin"]);
    assert_files_equal(&env.local("f.bin"), &env.share("dir/f.bin"));
});

ferrytest!(upload_into_existing_dir_without_trailing_slash, |env| {
    local_files(&env, &["f.bin"]);
    fs::create_dir(env.share("dir")).unwrap();
    env.rcp(rcp_args![env.local("f.bin"), env.remote("dir")])
        .assert_success();
    assert_entries(&env.share(""), &["dir"]);
    assert_entries(&env.share("dir"), &["f.bin"]);
    assert_files_equal(&env.local("f.bin"), &env.share("dir/f.bin"));
});

ferrytest!(upload_into_share_root, |env| {
    local_files(&env, &["a.bin", "b.bin"]);
    env.rcp(rcp_args![env.local("a.bin"), env.remote("")])
        .assert_success();
    env.rcp(rcp_args![
        env.local("b.bin"),
        format!("{}/", env.remote(""))
    ])
    .assert_success();
    assert_entries(&env.share(""), &["a.bin", "b.bin"]);
    assert_files_equal(&env.local("a.bin"), &env.share("a.bin"));
    assert_files_equal(&env.local("b.bin"), &env.share("b.bin"));
});

ferrytest!(upload_under_a_new_name, |env| {
    local_files(&env, &["f.bin"]);
    env.rcp(rcp_args![env.local("f.bin"), env.remote("newname")])
        .assert_success();
    assert_entries(&env.share(""), &["newname"]);
    assert_files_equal(&env.local("f.bin"), &env.share("newname"));
});

ferrytest!(upload_under_a_new_name_in_a_subdir, |env| {
    local_files(&env, &["f.bin"]);
    fs::create_dir_all(env.share("a/b")).unwrap();
    env.rcp(rcp_args![env.local("f.bin"), env.remote("a/b/renamed.bin")])
        .assert_success();
    assert_entries(&env.share("a/b"), &["renamed.bin"]);
    assert_files_equal(&env.local("f.bin"), &env.share("a/b/renamed.bin"));
});

ferrytest!(upload_several_sources_into_dir, |env| {
    let names = ["a.bin", "b.bin", "c.bin", "d.bin"];
    local_files(&env, &names);
    fs::create_dir(env.share("dir")).unwrap();
    let mut args = rcp_args!["-j", "2"];
    args.extend(names.iter().map(|n| env.local(n).into_os_string()));
    args.push(env.remote("dir/").into());
    env.rcp(args).assert_success();
    assert_entries(&env.share("dir"), &names);
    for name in names {
        assert_files_equal(&env.local(name), &env.share(&format!("dir/{name}")));
    }
    assert_no_temp_files(&env.share(""));
});

ferrytest!(upload_several_sources_to_missing_dir_fails, |env| {
    local_files(&env, &["a.bin", "b.bin"]);
    let dst = env.remote("nosuchdir");
    let out = env.rcp(rcp_args![env.local("a.bin"), env.local("b.bin"), dst]);
    // A usage error when rcp checks first; the server's "not a directory" otherwise.
    out.assert_code_in(&[2, 4])
        .assert_error_line(&dst, &["not a directory"]);
    assert_entries(&env.share(""), &[]);
});

ferrytest!(upload_several_sources_to_a_file_fails, |env| {
    local_files(&env, &["a.bin", "b.bin"]);
    let existing = env.share("file");
    write_random_file(&existing, 100, 99);
    let before = fs::read(&existing).unwrap();
    let dst = env.remote("file");
    let out = env.rcp(rcp_args![env.local("a.bin"), env.local("b.bin"), dst]);
    out.assert_code_in(&[2, 4])
        .assert_error_line(&dst, &["not a directory"]);
    assert_entries(&env.share(""), &["file"]);
    assert_eq!(
        fs::read(&existing).unwrap(),
        before,
        "the file was modified"
    );
});

ferrytest!(download_into_existing_local_dir, |env| {
    write_random_file(&env.share("f.bin"), MIB + 123, 5);
    fs::create_dir(env.local("dir")).unwrap();
    env.rcp(rcp_args![env.remote("f.bin"), env.local("dir")])
        .assert_success();
    assert_entries(&env.local("dir"), &["f.bin"]);
    assert_files_equal(&env.share("f.bin"), &env.local("dir/f.bin"));
});

ferrytest!(download_under_a_new_name, |env| {
    write_random_file(&env.share("f.bin"), 4321, 6);
    env.rcp(rcp_args![env.remote("f.bin"), env.local("renamed")])
        .assert_success();
    assert_entries(&env.local(""), &["renamed"]);
    assert_files_equal(&env.share("f.bin"), &env.local("renamed"));
});

ferrytest!(download_from_a_subdir, |env| {
    fs::create_dir_all(env.share("x/y")).unwrap();
    write_random_file(&env.share("x/y/f.bin"), 2 * MIB, 7);
    env.rcp(rcp_args![env.remote("x/y/f.bin"), env.local("")])
        .assert_success();
    assert_entries(&env.local(""), &["f.bin"]);
    assert_files_equal(&env.share("x/y/f.bin"), &env.local("f.bin"));
});

ferrytest!(download_several_sources_into_local_dir, |env| {
    let names = ["a.bin", "b.bin", "c.bin"];
    for (i, name) in names.iter().enumerate() {
        write_random_file(&env.share(name), 500 + i as u64 * MIB, 20 + i as u64);
    }
    fs::create_dir(env.local("dir")).unwrap();
    let mut args: Vec<std::ffi::OsString> = names.iter().map(|n| env.remote(n).into()).collect();
    args.push(env.local("dir").into_os_string());
    env.rcp(args).assert_success();
    assert_entries(&env.local("dir"), &names);
    for name in names {
        assert_files_equal(&env.share(name), &env.local(&format!("dir/{name}")));
    }
});

ferrytest!(download_several_sources_to_non_dir_fails, |env| {
    write_random_file(&env.share("a.bin"), 10, 30);
    write_random_file(&env.share("b.bin"), 10, 31);
    let dst = env.local("nosuchdir");
    let out = env.rcp(rcp_args![env.remote("a.bin"), env.remote("b.bin"), dst]);
    out.assert_code(2)
        .assert_error_line(&dst, &["not a directory"]);
    assert_entries(&env.local(""), &[]);
});

// Found in exploratory testing: a trailing '/' on the destination must name an existing
// directory (as with cp and scp), in both directions, and nothing is created.
ferrytest!(trailing_slash_destination_must_be_an_existing_dir, |env| {
    write_random_file(&env.local("f.bin"), 1000, 7);
    env.rcp(rcp_args![env.local("f.bin"), env.remote("newdir/")])
        .assert_code(2)
        .assert_stderr_has("not a directory");
    assert!(!env.share("newdir").exists());
    write_random_file(&env.share("g.bin"), 1000, 8);
    let dest = format!("{}/", env.local("nodir").display());
    env.rcp(rcp_args![env.remote("g.bin"), dest])
        .assert_code(2)
        .assert_stderr_has("not a directory");
    assert!(!env.local("nodir").exists());
});

// Found in exploratory testing: a tree download that collides with a local file must
// fail once for that directory and leave the user's file alone (bytes, mode, mtime).
ferrytest!(tree_download_onto_a_local_file_leaves_it_alone, |env| {
    fs::create_dir_all(env.share("tree/sub")).unwrap();
    write_random_file(&env.share("tree/sub/a"), 100, 9);
    set_mode(&env.share("tree"), 0o755);
    set_mtime(&env.share("tree"), 1_100_000_000);
    let local = env.local("lfile");
    fs::write(&local, b"mine").unwrap();
    set_mode(&local, 0o600);
    set_mtime(&local, 1_500_000_000);
    let out = env.rcp(rcp_args!["-r", env.remote("tree"), &local]);
    out.assert_code(5);
    assert_eq!(
        out.stderr
            .lines()
            .filter(|l| l.starts_with("rcp: "))
            .count(),
        1,
        "{out}"
    );
    assert_eq!(fs::read(&local).unwrap(), b"mine");
    assert_eq!(mode_of(&local), 0o600);
    assert_eq!(mtime_of(&local), 1_500_000_000);
});
