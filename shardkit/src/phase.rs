//! [`Phase`]: where a denormalisation rollout is (see [`crate::rollout`]).
//! A leaf: errors name phases, and the rollout feature acts on them.

/// Where a rollout is. See [`crate::rollout`] for what each phase does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Phase {
    /// Registered; nothing changes yet.
    Off,
    /// Every write fills the caches of both models; tables unchanged.
    CacheBoth,
    /// Writes of the old entity also write the new one, in the same
    /// transaction; reads come from the old table.
    DualWrite,
    /// Still dual-writing; reads come from the new table.
    ReadNew,
    /// Only the new table is written (old-entity writes are translated).
    NewOnly,
    /// Finished: writes of the old entity are refused.
    Done,
}

impl Phase {
    /// Every phase, in order.
    pub const ALL: [Phase; 6] = [
        Phase::Off,
        Phase::CacheBoth,
        Phase::DualWrite,
        Phase::ReadNew,
        Phase::NewOnly,
        Phase::Done,
    ];

    /// The name stored in the state table.
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Off => "off",
            Phase::CacheBoth => "cache_both",
            Phase::DualWrite => "dual_write",
            Phase::ReadNew => "read_new",
            Phase::NewOnly => "new_only",
            Phase::Done => "done",
        }
    }

    /// Parses [`as_str`](Self::as_str)'s output.
    pub fn parse(text: &str) -> Option<Phase> {
        Phase::ALL.into_iter().find(|p| p.as_str() == text)
    }

    /// The phase after this one.
    pub fn next(self) -> Option<Phase> {
        Phase::ALL.get(self as usize + 1).copied()
    }

    /// The phase before this one.
    pub fn previous(self) -> Option<Phase> {
        (self as usize).checked_sub(1).map(|i| Phase::ALL[i])
    }

    pub(crate) fn from_u8(v: u8) -> Phase {
        Phase::ALL[usize::from(v).min(Phase::ALL.len() - 1)]
    }

    pub(crate) fn caches(self) -> bool {
        self >= Phase::CacheBoth
    }

    pub(crate) fn writes_old(self) -> bool {
        self <= Phase::ReadNew
    }

    pub(crate) fn writes_new(self) -> bool {
        self >= Phase::DualWrite
    }

    pub(crate) fn reads_new(self) -> bool {
        self >= Phase::ReadNew
    }
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}
