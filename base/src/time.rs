//! Wall-clock time: the one module that reads the clock and the one type
//! for an instant, [`UnixNanos`].
//!
//! Records keep the units they always had on disk and in the control
//! plane: fields named `*_unix_nanos` are [`UnixNanos`], and fields named
//! `*_unix_ms` are [`UnixMillis`], its millisecond form. Both serialize as
//! a plain JSON number, exactly as the integers they replaced did.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

const NANOS_PER_MILLI: u64 = 1_000_000;
const NANOS_PER_SEC: u64 = 1_000_000_000;

/// An instant as nanoseconds since the Unix epoch (UTC). A u64 holds them
/// until the year 2554. `Display` is RFC 3339 UTC, to the second.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct UnixNanos(u64);

impl UnixNanos {
    /// 1970-01-01T00:00:00Z.
    pub const EPOCH: UnixNanos = UnixNanos(0);

    /// Now, by the system clock (the epoch if the clock is before it).
    pub fn now() -> UnixNanos {
        let since = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        UnixNanos::from_nanos_u128(since.as_nanos())
    }

    /// From nanoseconds since the epoch.
    pub const fn from_nanos(nanos: u64) -> UnixNanos {
        UnixNanos(nanos)
    }

    /// From nanoseconds since the epoch as a u128 (the pending-DEL queue's
    /// wire type); saturates past the year 2554.
    pub fn from_nanos_u128(nanos: u128) -> UnixNanos {
        UnixNanos(u64::try_from(nanos).unwrap_or(u64::MAX))
    }

    /// From milliseconds since the epoch; saturates past the year 2554.
    pub const fn from_millis(millis: u64) -> UnixNanos {
        UnixNanos(millis.saturating_mul(NANOS_PER_MILLI))
    }

    /// Nanoseconds since the epoch.
    pub const fn as_nanos(self) -> u64 {
        self.0
    }

    /// Whole milliseconds since the epoch.
    pub const fn as_millis(self) -> u64 {
        self.0 / NANOS_PER_MILLI
    }

    /// The time from `earlier` to `self`; zero if `earlier` is later.
    pub const fn saturating_duration_since(self, earlier: UnixNanos) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }

    /// `d` before `self`; the epoch if that is earlier.
    pub fn saturating_sub(self, d: Duration) -> UnixNanos {
        UnixNanos(
            self.0
                .saturating_sub(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)),
        )
    }
}

impl fmt::Display for UnixNanos {
    /// RFC 3339 UTC to the second, e.g. "2023-11-14T22:13:20Z"
    /// (civil-from-days).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // u64::MAX / 1e9 fits an i64.
        let secs = (self.0 / NANOS_PER_SEC) as i64;
        let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
        let z = days + 719_468;
        let era = z.div_euclid(146_097);
        let doe = z - era * 146_097;
        let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let day = doy - (153 * mp + 2) / 5 + 1;
        let month = if mp < 10 { mp + 3 } else { mp - 9 };
        let year = yoe + era * 400 + i64::from(month <= 2);
        write!(
            f,
            "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
            rem / 3600,
            rem % 3600 / 60,
            rem % 60
        )
    }
}

/// A [`UnixNanos`] kept to the millisecond, for the record fields that
/// have always stored milliseconds (`*_unix_ms`). Serializes as the number
/// of milliseconds; compares and round-trips exactly.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct UnixMillis(u64);

impl UnixMillis {
    /// 1970-01-01T00:00:00Z.
    pub const EPOCH: UnixMillis = UnixMillis(0);

    /// Now, by the system clock, truncated to the millisecond.
    pub fn now() -> UnixMillis {
        UnixNanos::now().into()
    }

    /// From milliseconds since the epoch.
    pub const fn from_millis(millis: u64) -> UnixMillis {
        UnixMillis(millis)
    }

    /// Milliseconds since the epoch.
    pub const fn as_millis(self) -> u64 {
        self.0
    }
}

impl From<UnixNanos> for UnixMillis {
    /// Truncates to the millisecond.
    fn from(t: UnixNanos) -> UnixMillis {
        UnixMillis(t.as_millis())
    }
}

impl From<UnixMillis> for UnixNanos {
    fn from(t: UnixMillis) -> UnixNanos {
        UnixNanos::from_millis(t.0)
    }
}

impl fmt::Display for UnixMillis {
    /// As [`UnixNanos`]: RFC 3339 UTC to the second.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        UnixNanos::from(*self).fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_rfc3339() {
        assert_eq!(UnixNanos::EPOCH.to_string(), "1970-01-01T00:00:00Z");
        let t = UnixNanos::from_nanos(1_700_000_000_000_000_000);
        assert_eq!(t.to_string(), "2023-11-14T22:13:20Z");
        let leap = UnixNanos::from_nanos(951_782_400_000_000_000);
        assert_eq!(leap.to_string(), "2000-02-29T00:00:00Z");
        // Sub-second parts are cut, not rounded.
        let t = UnixNanos::from_nanos(1_700_000_000_999_999_999);
        assert_eq!(t.to_string(), "2023-11-14T22:13:20Z");
        let ms = UnixMillis::from_millis(1_700_000_000_500);
        assert_eq!(ms.to_string(), "2023-11-14T22:13:20Z");
    }

    #[test]
    fn serializes_as_a_plain_number() {
        for n in [0u64, 1, 1_700_000_000_123_456_789, u64::MAX] {
            let t = UnixNanos::from_nanos(n);
            let json = serde_json::to_string(&t).unwrap();
            assert_eq!(json, serde_json::to_string(&n).unwrap());
            assert_eq!(serde_json::from_str::<UnixNanos>(&json).unwrap(), t);
            // What a u128 field wrote reads back the same.
            let wide = serde_json::to_string(&u128::from(n)).unwrap();
            assert_eq!(serde_json::from_str::<UnixNanos>(&wide).unwrap(), t);

            let m = UnixMillis::from_millis(n);
            let json = serde_json::to_string(&m).unwrap();
            assert_eq!(json, n.to_string());
            assert_eq!(serde_json::from_str::<UnixMillis>(&json).unwrap(), m);
        }
        #[derive(Serialize, Deserialize, PartialEq, Debug)]
        struct Record {
            created_unix_nanos: UnixNanos,
            since_unix_ms: UnixMillis,
        }
        let old = r#"{"created_unix_nanos":1700000000123456789,"since_unix_ms":1700000000123}"#;
        let r: Record = serde_json::from_str(old).unwrap();
        assert_eq!(r.created_unix_nanos.as_nanos(), 1_700_000_000_123_456_789);
        assert_eq!(r.since_unix_ms.as_millis(), 1_700_000_000_123);
        assert_eq!(serde_json::to_string(&r).unwrap(), old);
    }

    #[test]
    fn arithmetic_and_conversions() {
        let t = UnixNanos::from_nanos(5_123_456_789);
        assert_eq!(t.as_millis(), 5_123);
        assert_eq!(UnixMillis::from(t).as_millis(), 5_123);
        assert_eq!(
            UnixNanos::from(UnixMillis::from(t)),
            UnixNanos::from_millis(5_123)
        );
        assert_eq!(UnixNanos::from_millis(u64::MAX).as_nanos(), u64::MAX);
        assert_eq!(UnixNanos::from_nanos_u128(u128::MAX).as_nanos(), u64::MAX);
        assert_eq!(UnixNanos::from_nanos_u128(42).as_nanos(), 42);
        let later = UnixNanos::from_nanos(7_000_000_000);
        assert_eq!(
            later.saturating_duration_since(t),
            Duration::from_nanos(1_876_543_211)
        );
        assert_eq!(t.saturating_duration_since(later), Duration::ZERO);
        assert_eq!(
            later.saturating_sub(Duration::from_secs(2)),
            UnixNanos::from_nanos(5_000_000_000)
        );
        assert_eq!(t.saturating_sub(Duration::from_secs(60)), UnixNanos::EPOCH);
        assert!(UnixNanos::now() > UnixNanos::from_nanos(1_700_000_000_000_000_000));
    }
}
