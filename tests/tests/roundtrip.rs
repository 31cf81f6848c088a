//! Byte-identical single-file round trips around the 1 MiB chunk size: upload, check the
//! copy on the share, download it back under another name, check again. Mode and mtime
//! must survive both ways, and no temporary file may remain on the share.

use ferry_tests::{
    assert_entries, assert_files_equal, assert_no_temp_files, assert_same_mode_and_mtime,
    ferrytest, rcp_args, set_mode, set_mtime, write_random_file, Env, MIB,
};

/// Uploads a random file of `len` bytes with `mode`, then downloads it back.
fn roundtrip(env: &Env, len: u64, mode: u32) {
    let src = env.local("src.bin");
    write_random_file(&src, len, len ^ 0x5eed);
    set_mtime(&src, 1_234_567_890 + len % 1_000);
    set_mode(&src, mode);

    env.rcp(rcp_args![src, env.remote("up.bin")])
        .assert_success();
    let uploaded = env.share("up.bin");
    assert_entries(&env.share(""), &["up.bin"]);
    assert_no_temp_files(&env.share(""));
    assert_files_equal(&src, &uploaded);
    assert_same_mode_and_mtime(&src, &uploaded);

    let back = env.local("back.bin");
    env.rcp(rcp_args![env.remote("up.bin"), back])
        .assert_success();
    assert_files_equal(&src, &back);
    assert_same_mode_and_mtime(&src, &back);
    assert_entries(&env.local(""), &["src.bin", "back.bin"]);
}

ferrytest!(roundtrip_empty_file, |env| {
    roundtrip(&env, 0, 0o644);
});

ferrytest!(roundtrip_one_byte, |env| {
    roundtrip(&env, 1, 0o600);
});

ferrytest!(roundtrip_one_chunk_minus_one_byte, |env| {
    roundtrip(&env, MIB - 1, 0o755);
});

ferrytest!(roundtrip_exactly_one_chunk, |env| {
    roundtrip(&env, MIB, 0o640);
});

ferrytest!(roundtrip_one_chunk_plus_one_byte, |env| {
    roundtrip(&env, MIB + 1, 0o600);
});

ferrytest!(roundtrip_five_chunks_plus_17_bytes, |env| {
    roundtrip(&env, 5 * MIB + 17, 0o755);
});

ferrytest!(roundtrip_200_mib, |env| {
    roundtrip(&env, 200 * MIB, 0o644);
});

ferrytest!(upload_overwrites_an_existing_file, |env| {
    let old = env.share("f.bin");
    write_random_file(&old, 3 * MIB, 1);
    let src = env.local("f.bin");
    write_random_file(&src, MIB + 7, 2);
    set_mtime(&src, 1_111_111_111);
    set_mode(&src, 0o600);

    env.rcp(rcp_args![src, env.remote("f.bin")])
        .assert_success();
    assert_files_equal(&src, &old);
    assert_same_mode_and_mtime(&src, &old);
    assert_entries(&env.share(""), &["f.bin"]);
});

ferrytest!(download_overwrites_an_existing_local_file, |env| {
    let remote = env.share("f.bin");
    write_random_file(&remote, 2 * MIB + 3, 3);
    set_mtime(&remote, 1_222_222_222);
    set_mode(&remote, 0o640);
    let dst = env.local("f.bin");
    write_random_file(&dst, 5 * MIB, 4);

    env.rcp(rcp_args![env.remote("f.bin"), dst])
        .assert_success();
    assert_files_equal(&remote, &dst);
    assert_same_mode_and_mtime(&remote, &dst);
});
