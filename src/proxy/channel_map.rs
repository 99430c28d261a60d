//! [`ChannelMap`]: a connection's per-channel state, keyed by channel number and looked up
//! several times per forwarded frame. A slot per number up to the highest in use, so a
//! lookup is an index, not a hash probe (profiles of the forwarding path showed the probe of
//! a hash map of channels). Channel numbers are bounded by the negotiated channel_max (frames
//! above it are refused before any lookup), 2047 by default, so the slots take at most
//! 16 KiB, and only while such a number is in use; the values sit behind boxes.

/// Values keyed by channel number, in channel order.
#[derive(Debug)]
pub struct ChannelMap<V> {
    slots: Vec<Option<Box<V>>>,
    len: usize,
}

impl<V> Default for ChannelMap<V> {
    fn default() -> Self {
        ChannelMap {
            slots: Vec::new(),
            len: 0,
        }
    }
}

impl<V> ChannelMap<V> {
    pub fn get(&self, channel: &u16) -> Option<&V> {
        self.slots.get(usize::from(*channel))?.as_deref()
    }

    pub fn get_mut(&mut self, channel: &u16) -> Option<&mut V> {
        self.slots.get_mut(usize::from(*channel))?.as_deref_mut()
    }

    pub fn contains_key(&self, channel: &u16) -> bool {
        self.get(channel).is_some()
    }

    /// Sets the value of `channel`; the one it replaces, if any.
    pub fn insert(&mut self, channel: u16, value: V) -> Option<V> {
        let at = usize::from(channel);
        if self.slots.len() <= at {
            self.slots.resize_with(at + 1, || None);
        }
        let old = self.slots[at].replace(Box::new(value)).map(|old| *old);
        if old.is_none() {
            self.len += 1;
        }
        old
    }

    /// Removes the value of `channel`; the slots above the highest number left go too.
    pub fn remove(&mut self, channel: &u16) -> Option<V> {
        let old = self.slots.get_mut(usize::from(*channel))?.take()?;
        self.len -= 1;
        while self.slots.last().is_some_and(Option::is_none) {
            self.slots.pop();
        }
        if self.slots.capacity() > 2 * self.slots.len() + 16 {
            self.slots.shrink_to_fit();
        }
        Some(*old)
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// The channel numbers in use, in increasing order.
    pub fn keys(&self) -> impl Iterator<Item = u16> + '_ {
        self.iter().map(|(channel, _)| channel)
    }

    pub fn values(&self) -> impl Iterator<Item = &V> {
        self.slots.iter().filter_map(|slot| slot.as_deref())
    }

    /// The channels in use and their values, in increasing channel order.
    pub fn iter(&self) -> impl Iterator<Item = (u16, &V)> {
        self.slots.iter().enumerate().filter_map(|(at, slot)| {
            let value = slot.as_deref()?;
            Some((u16::try_from(at).ok()?, value))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_found_by_channel_number_and_listed_in_order() {
        let mut map = ChannelMap::default();
        assert!(map.len() == 0 && map.get(&0).is_none() && map.get(&u16::MAX).is_none());
        for n in [7u16, 1, 2047, 3] {
            assert_eq!(map.insert(n, u32::from(n) * 10), None);
        }
        assert_eq!(map.len(), 4);
        assert_eq!(map.get(&2047), Some(&20470));
        assert!(map.contains_key(&3) && !map.contains_key(&4) && !map.contains_key(&60000));
        assert_eq!(map.keys().collect::<Vec<_>>(), vec![1, 3, 7, 2047]);
        assert_eq!(
            map.values().copied().collect::<Vec<_>>(),
            vec![10, 30, 70, 20470]
        );
        *map.get_mut(&7).unwrap() += 1;
        assert_eq!(map.iter().nth(2), Some((7, &71)));
        // Replacing gives the old value back and does not count twice.
        assert_eq!(map.insert(7, 0), Some(71));
        assert_eq!(map.len(), 4);
    }

    #[test]
    fn removing_the_highest_number_gives_its_slots_back() {
        let mut map = ChannelMap::default();
        map.insert(1, "one");
        map.insert(2047, "last");
        assert_eq!(map.remove(&2047), Some("last"));
        assert_eq!(map.remove(&2047), None);
        assert_eq!(map.remove(&9000), None);
        assert_eq!((map.len(), map.slots.len()), (1, 2));
        assert!(map.slots.capacity() <= 2 * 2 + 16);
        assert_eq!(map.remove(&1), Some("one"));
        assert!(map.len() == 0 && map.slots.is_empty());
    }
}
