//! The message of a caught panic, for tests that check what `call` panics with.

/// The message of a panic payload (a `String` or a `&str`; empty otherwise).
pub fn panic_text(payload: Box<dyn std::any::Any + Send>) -> String {
    match payload.downcast::<String>() {
        Ok(s) => *s,
        Err(p) => p
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .unwrap_or_default(),
    }
}
