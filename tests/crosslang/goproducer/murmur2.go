package main

// Kafka's murmur2 and the contract's partition of a key (docs/producers.md section 1), used to
// check where the client placed each record.

func murmur2(key []byte) uint32 {
	const m, seed uint32 = 0x5bd1e995, 0x9747b28c
	h := seed ^ uint32(len(key))
	whole := len(key) - len(key)%4
	for i := 0; i < whole; i += 4 {
		k := uint32(key[i]) | uint32(key[i+1])<<8 | uint32(key[i+2])<<16 | uint32(key[i+3])<<24
		k *= m
		k ^= k >> 24
		k *= m
		h *= m
		h ^= k
	}
	switch len(key) % 4 {
	case 3:
		h ^= uint32(key[whole+2]) << 16
		fallthrough
	case 2:
		h ^= uint32(key[whole+1]) << 8
		fallthrough
	case 1:
		h ^= uint32(key[whole])
		h *= m
	}
	h ^= h >> 13
	h *= m
	h ^= h >> 15
	return h
}

func partitionFor(key []byte, partitions int) int {
	return int(murmur2(key)&0x7fffffff) % partitions
}
