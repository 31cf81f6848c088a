//! Many rcp processes against one ferryd at the same time.

use ferry_tests::{
    assert_entries, assert_files_equal, assert_no_temp_files, ferrytest, first_difference,
    rcp_args, spawn_rcp, write_random_file, MIB,
};

/// Uploads and downloads in flight at once (each).
const CLIENTS_PER_DIRECTION: u64 = 5;

ferrytest!(ten_clients_upload_and_download_at_once, |env| {
    let len = 8 * MIB;
    for i in 0..CLIENTS_PER_DIRECTION {
        write_random_file(&env.local(&format!("up{i}.bin")), len + i, 100 + i);
        write_random_file(&env.share(&format!("down{i}.bin")), len + i, 200 + i);
    }

    // Start every client before waiting for any.
    let mut children = Vec::new();
    for i in 0..CLIENTS_PER_DIRECTION {
        children.push(spawn_rcp(rcp_args![
            env.local(&format!("up{i}.bin")),
            env.remote(&format!("up{i}.bin"))
        ]));
        children.push(spawn_rcp(rcp_args![
            env.remote(&format!("down{i}.bin")),
            env.local(&format!("down{i}.bin"))
        ]));
    }
    for child in children {
        child.wait().assert_success();
    }

    for i in 0..CLIENTS_PER_DIRECTION {
        let up = format!("up{i}.bin");
        let down = format!("down{i}.bin");
        assert_files_equal(&env.local(&up), &env.share(&up));
        assert_files_equal(&env.share(&down), &env.local(&down));
    }
    assert_no_temp_files(&env.share(""));
    env.server().assert_running();
});

ferrytest!(racing_uploads_to_one_name_leave_one_whole_file, |env| {
    let sources: Vec<_> = (0..4u64)
        .map(|i| {
            let path = env.local(&format!("v{i}.bin"));
            write_random_file(&path, 3 * MIB + i * 1000, 300 + i);
            path
        })
        .collect();
    let children: Vec<_> = sources
        .iter()
        .map(|src| spawn_rcp(rcp_args![src, env.remote("same.bin")]))
        .collect();
    for child in children {
        child.wait().assert_success();
    }

    let dst = env.share("same.bin");
    let matches = sources
        .iter()
        .filter(|src| matches!(first_difference(src, &dst), Ok(None)))
        .count();
    assert_eq!(
        matches, 1,
        "same.bin must be exactly one of the uploaded versions, not a mix"
    );
    assert_entries(&env.share(""), &["same.bin"]);
    assert_no_temp_files(&env.share(""));
});
