//! The mux batch decoder must reject any input with an error, never panic,
//! and a batch it accepts must iterate exactly its declared records.
#![no_main]

use libfuzzer_sys::fuzz_target;
use qpmux::mux::protocol::BatchView;

fuzz_target!(|data: &[u8]| {
    if let Ok(view) = BatchView::new_checked(data) {
        assert_eq!(view.records().count(), usize::from(view.record_count()));
    }
});
