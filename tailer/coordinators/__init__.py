"""Who tails which shard, and where positions are committed: standalone (:mod:`.local`), ZooKeeper
(:mod:`.zookeeper`) and the store itself (:mod:`.store`); :mod:`.assignment` spreads shards over workers."""
