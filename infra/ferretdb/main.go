// Command saga-ferretdb serves the MongoDB wire protocol on loopback for the
// saga project's local services, using FerretDB v1 with its SQLite backend.
//
// It embeds FerretDB's public Go package instead of building FerretDB's own
// command, whose version stamp is only written by FerretDB's release tooling.
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"github.com/FerretDB/FerretDB/ferretdb"
)

func main() {
	listen := flag.String("listen-addr", "127.0.0.1:27017", "TCP address to listen on")
	sqliteURL := flag.String("sqlite-url", "file:data/", "SQLite URI of the data directory (must end with a slash)")
	level := flag.String("log-level", "warn", "log level: debug, info, warn or error")
	flag.Parse()

	var lvl slog.Level
	if err := lvl.UnmarshalText([]byte(*level)); err != nil {
		fmt.Fprintf(os.Stderr, "saga-ferretdb: bad --log-level %q: use debug, info, warn or error\n", *level)
		os.Exit(2)
	}
	logger := slog.New(&lazyAttrs{inner: slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: lvl})})

	db, err := ferretdb.New(&ferretdb.Config{
		Listener:  ferretdb.ListenerConfig{TCP: *listen},
		Logger:    logger,
		Handler:   "sqlite",
		SQLiteURL: *sqliteURL,
	})
	if err != nil {
		fmt.Fprintf(os.Stderr, "saga-ferretdb: cannot start: %v\n", err)
		os.Exit(1)
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	logger.Info("serving", "uri", db.MongoDBURI())
	if err := db.Run(ctx); err != nil && ctx.Err() == nil {
		fmt.Fprintf(os.Stderr, "saga-ferretdb: stopped: %v\n", err)
		os.Exit(1)
	}
}

// lazyAttrs defers a text handler's WithAttrs to the first record actually written.
//
// FerretDB derives a logger with the SQL text and arguments of every query it runs
// (Logger.With), and slog's text handler formats those attributes at once, record
// or not: about a tenth of the server's CPU on the saga participant's workload, for
// debug lines that are never written at the default level. Here the attributes are
// only kept, and formatted when a record passes the level.
type lazyAttrs struct {
	inner slog.Handler
	attrs []slog.Attr
}

func (h *lazyAttrs) Enabled(ctx context.Context, level slog.Level) bool {
	return h.inner.Enabled(ctx, level)
}

func (h *lazyAttrs) Handle(ctx context.Context, r slog.Record) error {
	return h.resolved().Handle(ctx, r)
}

func (h *lazyAttrs) WithAttrs(attrs []slog.Attr) slog.Handler {
	kept := make([]slog.Attr, 0, len(h.attrs)+len(attrs))
	kept = append(append(kept, h.attrs...), attrs...)
	return &lazyAttrs{inner: h.inner, attrs: kept}
}

// WithGroup formats the attributes kept so far: they belong outside the group.
func (h *lazyAttrs) WithGroup(name string) slog.Handler {
	return &lazyAttrs{inner: h.resolved().WithGroup(name)}
}

func (h *lazyAttrs) resolved() slog.Handler {
	if len(h.attrs) == 0 {
		return h.inner
	}
	return h.inner.WithAttrs(h.attrs)
}
