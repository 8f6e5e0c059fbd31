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
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: lvl}))

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
