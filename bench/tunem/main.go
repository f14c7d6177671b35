// tunem: a user-space stand-in for `tc qdisc ... netem delay D J rate R` between two TUN devices,
// for bench/bench_startup.py. This machine's kernel has no sch_netem (nor fq, sfq, cake): `tc qdisc
// add ... netem` answers "Specified qdisc kind is unknown", so the bench forwards every IP packet
// between the client's network namespace and the storage's through this program instead.
//
// Per direction, per packet (IPv4; TCP/UDP flows keyed by their 5-tuple):
//   - rate:      the interface serialises packets at -rate bit/s (its own transmit clock);
//   - flow rate: each flow (one TCP connection) at most -flow-rate bit/s (0: no per-flow limit),
//     standing for an object store's per-connection throughput;
//   - delay:     one-way -delay, plus a uniform jitter in [-jitter, +jitter], never reordering a flow
//     (a packet of a flow leaves no earlier than the one before it);
//   - queue:     a packet that would wait more than -queue-ms behind the interface's or its flow's
//     backlog is dropped (tail drop), so TCP sees the congestion a real bottleneck gives.
//
// Packets are otherwise untouched. Counters go to stderr on SIGTERM/SIGINT.
package main

import (
	"container/heap"
	"encoding/binary"
	"flag"
	"fmt"
	"math/rand"
	"os"
	"os/signal"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"
)

const (
	iffTun   = 0x0001
	iffNoPi  = 0x1000
	tunSetIf = 0x400454ca
)

func openTun(name string) (*os.File, error) {
	fd, err := syscall.Open("/dev/net/tun", syscall.O_RDWR|syscall.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	var req [40]byte
	copy(req[:16], name)
	binary.LittleEndian.PutUint16(req[16:], iffTun|iffNoPi)
	if _, _, e := syscall.Syscall(syscall.SYS_IOCTL, uintptr(fd), tunSetIf, uintptr(unsafe.Pointer(&req[0]))); e != 0 {
		syscall.Close(fd)
		return nil, fmt.Errorf("TUNSETIFF %s: %v", name, e)
	}
	return os.NewFile(uintptr(fd), name), nil
}

// openTunInNetns opens a persistent TUN device that lives in another network namespace.
func openTunInNetns(name, nsPath string) (*os.File, error) {
	type res struct {
		f   *os.File
		err error
	}
	ch := make(chan res)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread dies with the goroutine, namespace and all
		ns, err := os.Open(nsPath)
		if err != nil {
			ch <- res{nil, err}
			return
		}
		const sysSetns = 308
		if _, _, e := syscall.Syscall(sysSetns, ns.Fd(), syscall.CLONE_NEWNET, 0); e != 0 {
			ch <- res{nil, fmt.Errorf("setns %s: %v", nsPath, e)}
			return
		}
		f, err := openTun(name)
		ch <- res{f, err}
	}()
	r := <-ch
	return r.f, r.err
}

type pkt struct {
	due  int64
	seq  uint64
	data []byte
}
type pktHeap []*pkt

func (h pktHeap) Len() int { return len(h) }
func (h pktHeap) Less(i, j int) bool {
	if h[i].due != h[j].due {
		return h[i].due < h[j].due
	}
	return h[i].seq < h[j].seq
}
func (h pktHeap) Swap(i, j int)       { h[i], h[j] = h[j], h[i] }
func (h *pktHeap) Push(x interface{}) { *h = append(*h, x.(*pkt)) }
func (h *pktHeap) Pop() interface{} {
	old := *h
	p := old[len(old)-1]
	*h = old[:len(old)-1]
	return p
}

type flowState struct{ free, lastDue, lastSeen int64 }

type link struct {
	name                          string
	in, out                       *os.File
	delay, jitter                 int64   // ns
	rate, flowRate                float64 // bytes per ns (0: unlimited)
	queue                         int64   // ns
	mu                            sync.Mutex
	h                             pktHeap
	seq                           uint64
	ifFree                        int64
	flows                         map[[13]byte]*flowState
	wake                          chan struct{}
	rng                           *rand.Rand
	pkts, bytes, drops, flowDrops atomic.Uint64
	pool                          sync.Pool
}

func flowKey(b []byte) (k [13]byte) {
	if len(b) < 20 || b[0]>>4 != 4 {
		return
	}
	ihl := int(b[0]&0x0f) * 4
	copy(k[0:8], b[12:20])
	k[8] = b[9]
	if (b[9] == 6 || b[9] == 17) && len(b) >= ihl+4 {
		copy(k[9:13], b[ihl:ihl+4])
	}
	return
}

func (l *link) read() {
	for {
		buf := l.pool.Get().([]byte)
		n, err := l.in.Read(buf[:cap(buf)])
		if err != nil {
			fmt.Fprintf(os.Stderr, "%s: read: %v\n", l.name, err)
			os.Exit(1)
		}
		now := time.Now().UnixNano()
		data := buf[:n]
		l.mu.Lock()
		k := flowKey(data)
		fs := l.flows[k]
		if fs == nil {
			fs = &flowState{}
			l.flows[k] = fs
		}
		fs.lastSeen = now
		start := now
		if l.flowRate > 0 {
			if fs.free > start {
				start = fs.free
			}
			if start-now > l.queue {
				l.mu.Unlock()
				l.flowDrops.Add(1)
				l.pool.Put(buf)
				continue
			}
		}
		tx := start
		if l.ifFree > tx {
			tx = l.ifFree
		}
		if tx-now > l.queue {
			l.mu.Unlock()
			l.drops.Add(1)
			l.pool.Put(buf)
			continue
		}
		if l.rate > 0 {
			l.ifFree = tx + int64(float64(n)/l.rate)
		} else {
			l.ifFree = tx
		}
		if l.flowRate > 0 {
			fs.free = start + int64(float64(n)/l.flowRate)
		}
		due := l.ifFree + l.delay
		if l.jitter > 0 {
			due += l.rng.Int63n(2*l.jitter+1) - l.jitter
		}
		if due < fs.lastDue {
			due = fs.lastDue
		}
		fs.lastDue = due
		l.seq++
		heap.Push(&l.h, &pkt{due: due, seq: l.seq, data: data})
		if len(l.flows) > 4096 {
			for key, f := range l.flows {
				if now-f.lastSeen > int64(10*time.Second) {
					delete(l.flows, key)
				}
			}
		}
		l.mu.Unlock()
		select {
		case l.wake <- struct{}{}:
		default:
		}
	}
}

func (l *link) write() {
	timer := time.NewTimer(time.Hour)
	for {
		l.mu.Lock()
		if len(l.h) == 0 {
			l.mu.Unlock()
			<-l.wake
			continue
		}
		p := l.h[0]
		wait := p.due - time.Now().UnixNano()
		if wait > 20000 { // more than 20 µs early: sleep (or until an earlier packet arrives)
			l.mu.Unlock()
			timer.Reset(time.Duration(wait))
			select {
			case <-l.wake:
				if !timer.Stop() {
					<-timer.C
				}
			case <-timer.C:
			}
			continue
		}
		heap.Pop(&l.h)
		l.mu.Unlock()
		if _, err := l.out.Write(p.data); err == nil {
			l.pkts.Add(1)
			l.bytes.Add(uint64(len(p.data)))
		}
		l.pool.Put(p.data[:cap(p.data)])
	}
}

func main() {
	a := flag.String("a", "", "TUN device on this side (the client's)")
	b := flag.String("b", "", "TUN device on the storage's side")
	bns := flag.String("b-netns", "", "network namespace file of -b (e.g. /var/run/netns/NAME)")
	delay := flag.Duration("delay", 0, "one-way delay, each direction")
	jitter := flag.Duration("jitter", 0, "uniform jitter +- this, each direction (never reorders a flow)")
	rate := flag.Float64("rate-mbit", 0, "per-interface rate, each direction, Mbit/s (0: unlimited)")
	flowRate := flag.Float64("flow-rate-mbit", 0, "per-flow (per-connection) rate, each direction, Mbit/s (0: unlimited)")
	queue := flag.Duration("queue", 50*time.Millisecond, "drop a packet that would queue longer than this")
	flag.Parse()
	fa, err := openTun(*a)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	var fb *os.File
	if *bns != "" {
		fb, err = openTunInNetns(*b, *bns)
	} else {
		fb, err = openTun(*b)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	mk := func(name string, in, out *os.File, seed int64) *link {
		l := &link{name: name, in: in, out: out, delay: int64(*delay), jitter: int64(*jitter),
			rate: *rate * 1e6 / 8 / 1e9, flowRate: *flowRate * 1e6 / 8 / 1e9, queue: int64(*queue),
			flows: map[[13]byte]*flowState{}, wake: make(chan struct{}, 1), rng: rand.New(rand.NewSource(seed))}
		l.pool.New = func() interface{} { return make([]byte, 65536) }
		go l.read()
		go l.write()
		return l
	}
	up := mk("up", fa, fb, 1)     // client -> storage
	down := mk("down", fb, fa, 2) // storage -> client
	fmt.Println("ready")
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	<-sig
	for _, l := range []*link{up, down} {
		fmt.Fprintf(os.Stderr, `{"dir":%q,"packets":%d,"bytes":%d,"drops":%d,"flowDrops":%d}`+"\n",
			l.name, l.pkts.Load(), l.bytes.Load(), l.drops.Load(), l.flowDrops.Load())
	}
}
