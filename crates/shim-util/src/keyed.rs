//! [`KeyedLocks`]: one async lock per key, made on demand.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex, PoisonError};

/// One async lock per key (a mount point, a device), created on demand and dropped when no one
/// holds or waits for it.
#[derive(Debug)]
pub struct KeyedLocks<K> {
    locks: Mutex<HashMap<K, Arc<tokio::sync::Mutex<()>>>>,
}

impl<K> Default for KeyedLocks<K> {
    fn default() -> Self {
        Self {
            locks: Mutex::new(HashMap::new()),
        }
    }
}

impl<K: Hash + Eq> KeyedLocks<K> {
    /// Waits for `key`'s lock; held until the guard is dropped.
    pub async fn lock(&self, key: K) -> tokio::sync::OwnedMutexGuard<()> {
        let lock = {
            let mut map = self.locks.lock().unwrap_or_else(PoisonError::into_inner);
            // Only the map refers to it: nobody holds or waits for it.
            map.retain(|_, l| Arc::strong_count(l) > 1);
            map.entry(key).or_default().clone()
        };
        lock.lock_owned().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One key's holders wait for each other; another key's do not; nothing is kept once
    /// no one holds a key.
    #[tokio::test]
    async fn one_lock_per_key() {
        let locks = KeyedLocks::<&str>::default();
        let a = locks.lock("a").await;
        let b = tokio::time::timeout(std::time::Duration::from_millis(50), locks.lock("b")).await;
        assert!(b.is_ok(), "another key waits for nothing");
        let again = tokio::time::timeout(std::time::Duration::from_millis(50), locks.lock("a"));
        assert!(again.await.is_err(), "the same key waits");
        drop(a);
        drop(b);
        let _c = locks.lock("c").await;
        assert_eq!(
            locks.locks.lock().unwrap().len(),
            1,
            "only the one held is kept"
        );
    }
}
