#![no_main]
//! libFuzzer entry point of [`ferry_fuzz::codec_decode`].

libfuzzer_sys::fuzz_target!(|data: &[u8]| ferry_fuzz::codec_decode(data));
