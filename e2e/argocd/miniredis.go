// fewerbits-miniredis: the Redis that Argo CD's controller and repo server cache into, for the e2e
// harness only. miniredis is the in-memory Redis Argo CD's own tests use (it is in Argo CD's module
// graph); built by e2e/build.sh inside the Argo CD wrapper module so it takes that version.
package main

import (
	"flag"
	"log"

	"github.com/alicebob/miniredis/v2"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:6379", "address to listen on")
	flag.Parse()
	m := miniredis.NewMiniRedis()
	if err := m.StartAddr(*addr); err != nil {
		log.Fatalf("miniredis: %v", err)
	}
	log.Printf("miniredis listening on %s", m.Addr())
	select {}
}
