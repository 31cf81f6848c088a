#![no_main]
//! libFuzzer entry point of [`ferry_fuzz::tcp_frame`].

libfuzzer_sys::fuzz_target!(|data: &[u8]| ferry_fuzz::tcp_frame(data));
