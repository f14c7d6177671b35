// fewerbits-extproc-gateway: the smallest gateway that routes through an endpoint picker the way
// Envoy's ext_proc filter does (FULL_DUPLEX_STREAMED bodies), for the e2e tests only. No Envoy
// binary can be fetched here, so this plays the data plane; the picker it talks to is the real one.
//
// For each HTTP request it opens one ext_proc Process stream to the picker, sends the request
// headers and the whole body (end of stream), reads the header mutation that names the target
// (x-gateway-destination-endpoint) and the mutated body, forwards the request to that endpoint,
// then sends the response headers and body through the same stream (so the picker sees the
// request finish, as it does behind Envoy). An ImmediateResponse from the picker (no capacity, no
// pods) is returned to the caller as is. The chosen endpoint is echoed in X-Fewerbits-Endpoint.
//
//	fewerbits-extproc-gateway --listen 127.0.0.1:18080 --picker 127.0.0.1:9002
package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"flag"
	"fmt"
	"io"
	"log"
	"net/http"
	"strconv"
	"strings"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extproc "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
)

const destinationHeader = "x-gateway-destination-endpoint"

type gateway struct {
	picker extproc.ExternalProcessorClient
	client *http.Client
}

func headerMap(h http.Header, extra map[string]string) *corev3.HeaderMap {
	m := &corev3.HeaderMap{}
	for k, v := range extra {
		m.Headers = append(m.Headers, &corev3.HeaderValue{Key: k, RawValue: []byte(v)})
	}
	for k, vs := range h {
		m.Headers = append(m.Headers, &corev3.HeaderValue{Key: strings.ToLower(k), RawValue: []byte(strings.Join(vs, ","))})
	}
	return m
}

func (g *gateway) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), 5*time.Minute)
	defer cancel()
	body, err := io.ReadAll(r.Body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	stream, err := g.picker.Process(ctx)
	if err != nil {
		http.Error(w, "endpoint picker unreachable: "+err.Error(), http.StatusBadGateway)
		return
	}
	defer stream.CloseSend()
	pseudo := map[string]string{":method": r.Method, ":path": r.URL.RequestURI(), ":authority": r.Host, ":scheme": "http"}
	if err := stream.Send(&extproc.ProcessingRequest{Request: &extproc.ProcessingRequest_RequestHeaders{
		RequestHeaders: &extproc.HttpHeaders{Headers: headerMap(r.Header, pseudo)}}}); err != nil {
		http.Error(w, "ext_proc send: "+err.Error(), http.StatusBadGateway)
		return
	}
	if err := stream.Send(&extproc.ProcessingRequest{Request: &extproc.ProcessingRequest_RequestBody{
		RequestBody: &extproc.HttpBody{Body: body, EndOfStream: true}}}); err != nil {
		http.Error(w, "ext_proc send: "+err.Error(), http.StatusBadGateway)
		return
	}
	// The picker answers the headers (with the target) once it has the whole body, then the body.
	target := ""
	setHeaders := map[string]string{}
	var newBody bytes.Buffer
	for done := false; !done; {
		resp, err := stream.Recv()
		if err != nil {
			http.Error(w, "ext_proc recv: "+err.Error(), http.StatusBadGateway)
			return
		}
		switch v := resp.Response.(type) {
		case *extproc.ProcessingResponse_ImmediateResponse:
			code := int(v.ImmediateResponse.GetStatus().GetCode())
			if code == 0 {
				code = http.StatusServiceUnavailable
			}
			w.Header().Set("X-Fewerbits-Picker", "immediate-response")
			w.WriteHeader(code)
			_, _ = w.Write(v.ImmediateResponse.GetBody())
			return
		case *extproc.ProcessingResponse_RequestHeaders:
			for _, h := range v.RequestHeaders.GetResponse().GetHeaderMutation().GetSetHeaders() {
				val := string(h.GetHeader().GetRawValue())
				if val == "" {
					val = h.GetHeader().GetValue()
				}
				setHeaders[strings.ToLower(h.GetHeader().GetKey())] = val
			}
			target = setHeaders[destinationHeader]
		case *extproc.ProcessingResponse_RequestBody:
			sr := v.RequestBody.GetResponse().GetBodyMutation().GetStreamedResponse()
			newBody.Write(sr.GetBody())
			done = sr.GetEndOfStream()
		}
	}
	if target == "" {
		http.Error(w, "the endpoint picker named no endpoint", http.StatusBadGateway)
		return
	}
	// The picker may name several endpoints (fallbacks), comma separated: take the first.
	target = strings.TrimSpace(strings.Split(target, ",")[0])
	up, err := http.NewRequestWithContext(ctx, r.Method, "http://"+target+r.URL.RequestURI(), bytes.NewReader(newBody.Bytes()))
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	for k, vs := range r.Header {
		up.Header[k] = vs
	}
	for k, v := range setHeaders {
		if !strings.HasPrefix(k, ":") && k != "content-length" {
			up.Header.Set(k, v)
		}
	}
	res, err := g.client.Do(up)
	if err != nil {
		http.Error(w, "upstream "+target+": "+err.Error(), http.StatusBadGateway)
		return
	}
	defer res.Body.Close()
	resBody, _ := io.ReadAll(res.Body)
	// Response through the picker: it counts the request as finished and reads the usage.
	_ = stream.Send(&extproc.ProcessingRequest{Request: &extproc.ProcessingRequest_ResponseHeaders{
		ResponseHeaders: &extproc.HttpHeaders{Headers: headerMap(res.Header, map[string]string{"status": strconv.Itoa(res.StatusCode)})}}})
	_ = stream.Send(&extproc.ProcessingRequest{Request: &extproc.ProcessingRequest_ResponseBody{
		ResponseBody: &extproc.HttpBody{Body: resBody, EndOfStream: true}}})
	for k, vs := range res.Header {
		w.Header()[k] = vs
	}
	w.Header().Set("X-Fewerbits-Endpoint", target)
	w.Header().Set("Content-Length", strconv.Itoa(len(resBody)))
	w.WriteHeader(res.StatusCode)
	_, _ = w.Write(resBody)
	if f, ok := w.(http.Flusher); ok {
		f.Flush() // the client has its answer now, whatever the picker does next
	}
	// Drain the picker's answers to the response, bounded: it counts the request finished.
	drained := make(chan struct{})
	go func() {
		defer close(drained)
		for {
			resp, err := stream.Recv()
			if err != nil {
				return
			}
			if rb, ok := resp.Response.(*extproc.ProcessingResponse_ResponseBody); ok &&
				rb.ResponseBody.GetResponse().GetBodyMutation().GetStreamedResponse().GetEndOfStream() {
				return
			}
		}
	}()
	select {
	case <-drained:
	case <-time.After(5 * time.Second):
		log.Printf("picker did not answer the response of %s within 5s", target)
	}
}

func main() {
	listen := flag.String("listen", "127.0.0.1:18080", "HTTP address to serve")
	picker := flag.String("picker", "127.0.0.1:9002", "the endpoint picker's ext_proc gRPC address")
	pickerTLS := flag.Bool("picker-tls", false, "speak TLS to the picker without verifying its certificate "+
		"(the EPP's default --secure-serving uses a self-signed one; Envoy-based gateways are configured the same way)")
	flag.Parse()
	creds := insecure.NewCredentials()
	if *pickerTLS {
		creds = credentials.NewTLS(&tls.Config{InsecureSkipVerify: true})
	}
	conn, err := grpc.NewClient(*picker, grpc.WithTransportCredentials(creds))
	if err != nil {
		log.Fatalf("picker %s: %v", *picker, err)
	}
	g := &gateway{picker: extproc.NewExternalProcessorClient(conn), client: &http.Client{Timeout: 5 * time.Minute}}
	fmt.Printf("fewerbits-extproc-gateway listening on %s, picker %s\n", *listen, *picker)
	log.Fatal(http.ListenAndServe(*listen, g))
}
