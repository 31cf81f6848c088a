#![no_main]
//! libFuzzer entry point of [`ferry_fuzz::server_session`].

libfuzzer_sys::fuzz_target!(|data: &[u8]| ferry_fuzz::server_session(data));
