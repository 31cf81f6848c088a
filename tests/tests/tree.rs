//! Recursive copies (`-r`): a tree of more than 1,000 files with empty directories,
//! symlinks, modes and mtimes goes up and comes back identical; placement under an
//! existing directory; directories without `-r` are refused.

use std::fs;

use ferry_tests::{
    assert_entries, assert_no_temp_files, assert_trees_equal, ferrytest, make_small_tree,
    make_tree, rcp_args, write_random_file,
};

ferrytest!(tree_upload_then_download_is_identical, |env| {
    let src = env.local("src");
    let stats = make_tree(&src, 42);
    assert!(stats.files >= 1_000, "generator made only {stats:?}");

    env.rcp(rcp_args!["-r", src, env.remote("dst")])
        .assert_success();
    assert_entries(&env.share(""), &["dst"]);
    assert_no_temp_files(&env.share(""));
    assert_trees_equal(&src, &env.share("dst"));

    let back = env.local("back");
    env.rcp(rcp_args!["-r", env.remote("dst"), back])
        .assert_success();
    assert_no_temp_files(&env.local(""));
    assert_trees_equal(&src, &back);
});

ferrytest!(tree_upload_into_existing_dir_nests_it, |env| {
    let src = env.local("src");
    make_small_tree(&src, 1);
    fs::create_dir(env.share("existing")).unwrap();
    env.rcp(rcp_args!["-r", src, env.remote("existing")])
        .assert_success();
    assert_entries(&env.share("existing"), &["src"]);
    assert_trees_equal(&src, &env.share("existing/src"));
    assert_no_temp_files(&env.share(""));
});

ferrytest!(tree_upload_into_existing_dir_with_trailing_slash, |env| {
    let src = env.local("src");
    make_small_tree(&src, 2);
    fs::create_dir(env.share("existing")).unwrap();
    env.rcp(rcp_args!["-r", src, env.remote("existing/")])
        .assert_success();
    assert_entries(&env.share("existing"), &["src"]);
    assert_trees_equal(&src, &env.share("existing/src"));
});

ferrytest!(tree_download_to_a_new_name, |env| {
    let tree = env.share("t");
    make_small_tree(&tree, 3);
    env.rcp(rcp_args!["-r", env.remote("t"), env.local("copy")])
        .assert_success();
    assert_entries(&env.local(""), &["copy"]);
    assert_trees_equal(&tree, &env.local("copy"));
});

ferrytest!(tree_download_into_existing_local_dir_nests_it, |env| {
    let tree = env.share("t");
    make_small_tree(&tree, 4);
    fs::create_dir(env.local("existing")).unwrap();
    env.rcp(rcp_args!["-r", env.remote("t"), env.local("existing")])
        .assert_success();
    assert_entries(&env.local("existing"), &["t"]);
    assert_trees_equal(&tree, &env.local("existing/t"));
});

ferrytest!(tree_upload_of_an_empty_dir, |env| {
    let src = env.local("empty");
    fs::create_dir(&src).unwrap();
    ferry_tests::set_mode(&src, 0o750);
    ferry_tests::set_mtime(&src, 1_400_000_000);
    env.rcp(rcp_args!["-r", src, env.remote("e")])
        .assert_success();
    assert_entries(&env.share(""), &["e"]);
    assert_trees_equal(&src, &env.share("e"));
});

ferrytest!(directory_upload_without_r_fails_and_names_it, |env| {
    let src = env.local("somedir");
    make_small_tree(&src, 5);
    let out = env.rcp(rcp_args![src, env.remote("x")]);
    out.assert_code(2).assert_error_line(&src, &[]);
    assert_entries(&env.share(""), &[]);
});

ferrytest!(directory_download_without_r_fails_and_names_it, |env| {
    make_small_tree(&env.share("remotedir"), 6);
    let remote = env.remote("remotedir");
    let out = env.rcp(rcp_args![remote, env.local("x")]);
    out.assert_code(2).assert_error_line(&remote, &[]);
    assert_entries(&env.local(""), &[]);
});

ferrytest!(directory_without_r_is_skipped_but_files_are_copied, |env| {
    write_random_file(&env.local("file.bin"), 5000, 7);
    make_small_tree(&env.local("somedir"), 7);
    let out = env.rcp(rcp_args![
        env.local("somedir"),
        env.local("file.bin"),
        env.remote("")
    ]);
    out.assert_code(2)
        .assert_error_line(env.local("somedir"), &[]);
    assert_entries(&env.share(""), &["file.bin"]);
    ferry_tests::assert_files_equal(&env.local("file.bin"), &env.share("file.bin"));
});
